"""The pipeline partition a profile plans, measured against the partitions DeepSpeed's own methods make, on a GPT
whose large-vocabulary LM head weighs down the last stage.

    python bench/partition_speedup.py                  # pp 2 and pp 4, 5 interleaved rounds
    python bench/partition_speedup.py --pp 2 --rounds 3
    python bench/partition_speedup.py --pp 4 --rounds 3 --checkpoint-activations   # every layer recomputed
    python bench/partition_speedup.py --pp 2 --rounds 5 --shape first-try --checkpoint-activations
    python bench/partition_speedup.py --quick          # the tiny GPT at pp 2, one round: a smoke run
    python bench/partition_speedup.py --upstream DIR --upstream-python PY --pp 2   # upstream's pretrain_gpt.py

For each pipeline size: one run under the default partition (type:ParallelTransformerLayerPipe, upstream's
hard-coded type:transformer) profiles an iteration, and its report plans a partition and predicts the
iteration time under it. Then rounds of launches, interleaved so that the machine's drift falls on every
method alike: the default, DeepSpeed's 'parameters' and 'type:transformer|embedding' (Megatron-DeepSpeed's
other documented choice; here the pattern reads ParallelTransformerLayerPipe|EmbeddingPipe|LMHeadPipe), and
the plan (--pp-partition-from-profile). Each launch is pretrain_gpt.py under the deepspeed launcher (one thread
a rank); its time is the median of its log lines' iteration times after the warm-up, and it profiles its
last iteration, after those, to say which parts it ran. A method's time is the median over the rounds. The
plan's prediction is given twice: from the profiled run that made the plan, and as the median of what each
round's default run (profiled too) predicts for the same parts; each is compared with the plan's median.

--upstream DIR runs upstream Megatron-DeepSpeed's pretrain_gpt.py from that checkout instead, through
`deepspeed --module patches.launch` in the environment of --upstream-python (DeepSpeed <= 0.19.6 and this
project installed; see the README's upstream tier). Its GPTModelPipe hard-codes type:transformer, so the
default and the plan are the two partitions it can run; the model is UPSTREAM_SHAPE (micro-batch 1: upstream
needs flash attention above 1 on CPU) on the demo corpus, its BPE vocabulary grown to GPT-2's size, the LM head
tied to the embedding (upstream's default), and tests/upstream_shim fills upstream's CPU gaps, as in the tests.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

# A script: its own directory is on sys.path, so the sibling harness imports by name.
from harness import free_port, load, machine, table

from patches.partition.report_plan import PlanRequest, plan_of

REPO = Path(__file__).resolve().parents[1]

# hidden 128, 8 layers: a transformer layer does ~0.5 MFLOPs a token forward, the LM head over 16,384 words
# ~4.2 MFLOPs (and a softmax over them): the head is worth about eight layers, all on the last stage
UNBALANCED = {"hidden": 128, "heads": 4, "layers": 8, "seq": 128, "micro_batch": 4, "micro_batches": 8,
              "vocab": 16384}
# upstream: GPT-2's vocabulary size (50,304 padded), tied, over hidden 64: the head and its loss weigh more than
# the eight layers; seq 512 at micro-batch 1 keeps the GEMMs large
GPT2_VOCAB = 50257
# a new user's first try (hidden 256, the LM head tied to the embedding, 4 micro-batches of 2): --shape first-try
FIRST_TRY = {"hidden": 256, "heads": 4, "layers": 8, "seq": 128, "micro_batch": 2, "micro_batches": 4,
             "vocab": 16384, "tied": True}
# --shape's choices
SHAPES = {"unbalanced": UNBALANCED, "first-try": FIRST_TRY}
UPSTREAM_SHAPE = {"hidden": 64, "heads": 4, "layers": 8, "seq": 512, "micro_batch": 1, "micro_batches": 8}
UPSTREAM_QUICK = {"hidden": 64, "heads": 4, "layers": 4, "seq": 32, "micro_batch": 1, "micro_batches": 4}
TINY = {"hidden": 32, "heads": 4, "layers": 4, "seq": 16, "micro_batch": 2, "micro_batches": 4, "vocab": 2048}
DEFAULT = "type:ParallelTransformerLayerPipe"
DEFAULT_NAME = "default (type:transformer)"
METHODS = {DEFAULT_NAME: DEFAULT, "parameters": "parameters",
           "type:transformer|embedding": "type:ParallelTransformerLayerPipe|EmbeddingPipe|LMHeadPipe"}
PLANNED = "planned from the profile"
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")


def gpt_flags(shape, pp, iterations):
    """Flags our pretrain_gpt.py and upstream's both take."""
    return [
        "--num-layers", shape["layers"], "--hidden-size", shape["hidden"], "--num-attention-heads", shape["heads"],
        "--seq-length", shape["seq"], "--max-position-embeddings", shape["seq"],
        "--micro-batch-size", shape["micro_batch"],
        "--global-batch-size", shape["micro_batch"] * shape["micro_batches"],
        "--pipeline-model-parallel-size", pp, "--hidden-dropout", 0, "--attention-dropout", 0,
        "--lr", 1e-4, "--train-iters", iterations, "--eval-iters", 0, "--log-interval", 1, "--seed", 1234,
    ]


@dataclass
class Target:
    """Whose pretrain_gpt.py runs, how it is launched, and which partitions it can be asked for."""
    name: str
    deepspeed: str  # the launcher of the environment to run in
    launcher_args: List[str]  # before the script: ["--module", "patches.launch"] for upstream
    script: str
    cwd: Optional[Path]  # None: the launch's own output directory
    flags: List[str]  # the model's and data's flags beyond gpt_flags
    env: Dict[str, str]
    methods: Dict[str, List[str]]  # a partition's name: its flags


def fork_target(shape):
    flags = ["--synthetic-vocab-size", shape["vocab"], "--make-vocab-size-divisible-by", 8]
    if not shape.get("tied"):
        flags.append("--untie-embeddings-and-output-weights")
    methods = {name: ["--pp-partition-method", method] for name, method in METHODS.items()}
    return Target("this repository's pretrain_gpt.py", str(Path(sys.executable).parent / "deepspeed"), [],
                  str(REPO / "pretrain_gpt.py"), None, flags, {"PYTHONPATH": str(REPO)}, methods)


def upstream_target(checkout, python, shape, work):
    """Upstream's pretrain_gpt.py on the demo corpus (tools/preprocess_data.py, about a second), on CPU."""
    demo = REPO / "tools" / "demo_corpus"
    merges, prefix = demo / "merges.txt", work / "demo"
    # the demo's BPE vocabulary grown to GPT-2's 50,257 entries (ids past the demo's are never produced), so
    # that the tied LM head is GPT-2's size: 50,304 rows once upstream pads it
    encoder = json.loads((demo / "vocab.json").read_text())
    encoder.update({f"<unused_{i}>": i for i in range(len(encoder), GPT2_VOCAB)})
    vocab = work / "vocab.json"
    vocab.write_text(json.dumps(encoder))
    subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(demo / "docs.jsonl"),
                    "--output-prefix", str(prefix), "--vocab-file", str(vocab), "--merge-file", str(merges),
                    "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "1"],
                   check=True, capture_output=True)
    ds_config = work / "ds_config.json"
    ds_config.write_text(json.dumps({
        "train_batch_size": shape["micro_batch"] * shape["micro_batches"],
        "train_micro_batch_size_per_gpu": shape["micro_batch"], "steps_per_print": 1000,
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}))
    flags = ["--split", "100,0,0", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
             "--merge-file", merges, "--data-path", f"{prefix}_text_document", "--distributed-backend", "gloo",
             "--deepspeed", "--deepspeed_config", ds_config, "--no-gradient-accumulation-fusion", "--min-lr", 1e-5,
             "--lr-decay-style", "constant", "--eval-interval", 1000]
    # upstream's CPU gaps, filled for its test tier; its JIT-built CPU op gets a cache of its own DeepSpeed
    # ($UPSTREAM_TORCH_EXTENSIONS_DIR to keep it between runs: the build takes minutes on 2 cores)
    env = {"PYTHONPATH": str(REPO / "tests" / "upstream_shim"),
           "TORCH_EXTENSIONS_DIR": os.environ.get("UPSTREAM_TORCH_EXTENSIONS_DIR", str(work / "torch_extensions"))}
    methods = {DEFAULT_NAME: []}  # GPTModelPipe's hard-coded type:transformer
    version = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                             text=True, check=True).stdout.split()[-1]
    return Target(f"upstream's pretrain_gpt.py ({checkout}, DeepSpeed {version})",
                  str(Path(python).parent / "deepspeed"), ["--module", "patches.launch"], "pretrain_gpt.py",
                  Path(checkout), flags, env, methods)


def launch(target, shape, pp, iterations, partition_flags, out_dir, step=None):
    """pretrain_gpt.py on pp ranks, iteration `step` (default: the last) profiled into out_dir; returns
    ({iteration: ms}, report)."""
    step = step or iterations
    command = [target.deepspeed, "--num_gpus", str(pp), "--master_port", str(free_port())]
    command += target.launcher_args + [target.script]
    command += [str(flag) for flag in gpt_flags(shape, pp, iterations) + target.flags + partition_flags]
    command += ["--profile-flops-step", str(step), "--profile-flops-output", str(out_dir)]
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", **target.env)
    process = subprocess.run(command, cwd=target.cwd or out_dir, env=env, capture_output=True, text=True)
    if process.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{process.stdout[-3000:]}\n{process.stderr[-3000:]}")
    times = {int(m.group(1)): float(m.group(2)) for m in _ITERATION.finditer(process.stdout)}
    report = json.loads((out_dir / f"flops_profile_step{step}.json").read_text())
    return times, report


def steady_ms(times, warmup, iterations, step=None):
    """The median iteration time after the warm-up, leaving out the counting and the profiled iterations (step:
    the profiled one, default the last) and step + 3, whose log line includes delivering the report (it waits
    for 3 iterations after the step; where the run ends sooner, it comes after the last log line)."""
    step = step or iterations
    left_out = {step - 1, step, step + 3}
    return statistics.median(ms for it, ms in times.items() if warmup < it <= iterations and it not in left_out)


def measure(target, shape, pp, rounds, iterations, warmup, work):
    print(f"pp {pp}, {target.name}: profiling the default partition ...", flush=True)
    _, report = launch(target, shape, pp, iterations, target.methods[DEFAULT_NAME], work / f"pp{pp}_profile")
    plan_path = work / f"pp{pp}_profile" / f"flops_profile_step{iterations}.json"
    plan = report["partition_plan"]
    runs = dict(target.methods)
    runs[PLANNED] = ["--pp-partition-from-profile", str(plan_path)]
    measured = {name: [] for name in runs}
    parts, predictions = {}, []
    for round_ in range(rounds):
        for name, flags in runs.items():
            out = work / f"pp{pp}_round{round_}_{list(runs).index(name)}"
            times, run_report = launch(target, shape, pp, iterations, flags, out)
            measured[name].append(steady_ms(times, warmup, iterations))
            parts[name] = run_report["partition_plan"]["current_parts"]
            if name == DEFAULT_NAME:  # its profile predicts the plan anew, from this round's measurement
                predictions.append(plan_of(run_report, PlanRequest(parts=plan["parts"]))["predicted_iter_s"] * 1000)
            print(f"  round {round_ + 1}/{rounds} {name}: parts {parts[name]}, "
                  f"{measured[name][-1]:.1f} ms", flush=True)
    return plan, parts, measured, predictions


def print_results(target, pp, plan, parts, measured, predictions, shape):
    """One table: each partition's median; the plan's prediction, from the profiled run and from every round's
    default run (the median of those), against the plan's measured median."""
    default_ms = statistics.median(measured[DEFAULT_NAME])
    planned_ms = statistics.median(measured[PLANNED])
    rows = []
    for name, times in measured.items():
        ms = statistics.median(times)
        rows.append([name, str(parts[name]), f"{ms:.1f}", f"{ms / default_ms:.3f}"])
    profiled = plan["predicted_iter_s"] * 1000
    recomputed = ", every layer recomputed" if "--checkpoint-activations" in target.flags else ""
    print(f"\n{target.name}, pp {pp}, {len(measured[PLANNED])} rounds{recomputed}; shape {shape}")
    if pp > (os.cpu_count() or 1):
        print(f"note: {pp} ranks on {os.cpu_count()} cores share them: the machine's total work, not the bounding "
              "stage alone, sets the pace (the plan predicts by DeepSpeed's schedule run on the CPUs they share)")
    print(table(["partition", "parts", "median ms/iter", "/ default"], rows))
    print(f"the plan {plan['parts']}, predicted by the profiled run (its default partition measured "
          f"{plan['measured_iter_s'] * 1000:.1f} ms): {profiled:.1f} ms ({profiled / planned_ms - 1:+.1%} off the "
          f"plan's measured {planned_ms:.1f} ms)")
    median = statistics.median(predictions)
    print(f"predicted by each round's default run: median {median:.1f} ms ({median / planned_ms - 1:+.1%} off), "
          f"from {min(predictions):.1f} to {max(predictions):.1f} ms")
    rounds = ", ".join(f"{planned / default - 1:+.1%}" for planned, default in zip(measured[PLANNED],
                                                                                    measured[DEFAULT_NAME]))
    print(f"the plan's change from the default: predicted {plan['predicted_change']:+.1%} (the profiled run), "
          f"measured {planned_ms / default_ms - 1:+.1%} (the medians; round by round {rounds})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=12, help="per launch, the last profiled")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the tiny GPT at pp 2, one round: a smoke run")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="unbalanced",
                        help="the fork's GPT: the untied head over 16,384 words (default), or FIRST_TRY's")
    parser.add_argument("--checkpoint-activations", action="store_true",
                        help="every launch recomputes every transformer layer (Megatron's flag)")
    parser.add_argument("--upstream", metavar="DIR", help="an upstream Megatron-DeepSpeed checkout to run instead")
    parser.add_argument("--upstream-python", metavar="PY", default=sys.executable,
                        help="the interpreter of the environment upstream runs in (default: this one)")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    pps, rounds, iterations, warmup = args.pp, args.rounds, args.iterations, args.warmup
    if args.quick:
        shape, pps, rounds, iterations, warmup = TINY, [2], 1, 5, 1
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory(prefix="partition_speedup_") as work:
        target = fork_target(shape)
        if args.upstream:
            shape = UPSTREAM_QUICK if args.quick else UPSTREAM_SHAPE
            target = upstream_target(args.upstream, args.upstream_python, shape, Path(work))
        if args.checkpoint_activations:
            target.flags.append("--checkpoint-activations")
        for pp in pps:
            plan, parts, measured, predictions = measure(target, shape, pp, rounds, iterations, warmup, Path(work))
            print_results(target, pp, plan, parts, measured, predictions, shape)
    print(f"after: {load()}")


if __name__ == "__main__":
    main()
