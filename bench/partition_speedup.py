"""The pipeline partition a profile plans, measured against the partitions DeepSpeed's own methods make, on a GPT
whose large-vocabulary LM head weighs down the last stage.

    python bench/partition_speedup.py                  # pp 2 and pp 4, 5 interleaved rounds
    python bench/partition_speedup.py --pp 2 --rounds 3
    python bench/partition_speedup.py --quick          # the tiny GPT at pp 2, one round: a smoke run

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
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# A script: its own directory is on sys.path, so the sibling harness imports by name.
from harness import free_port, load, machine, table

from patches.partition_profile import plan_of

REPO = Path(__file__).resolve().parents[1]

# hidden 128, 8 layers: a transformer layer does ~0.5 MFLOPs a token forward, the LM head over 16,384 words
# ~4.2 MFLOPs (and a softmax over them): the head is worth about eight layers, all on the last stage
UNBALANCED = {"hidden": 128, "heads": 4, "layers": 8, "seq": 128, "micro_batch": 4, "micro_batches": 8,
              "vocab": 16384}
TINY = {"hidden": 32, "heads": 4, "layers": 4, "seq": 16, "micro_batch": 2, "micro_batches": 4, "vocab": 2048}
DEFAULT = "type:ParallelTransformerLayerPipe"
DEFAULT_NAME = "default (type:transformer)"
METHODS = {DEFAULT_NAME: DEFAULT, "parameters": "parameters",
           "type:transformer|embedding": "type:ParallelTransformerLayerPipe|EmbeddingPipe|LMHeadPipe"}
PLANNED = "planned from the profile"
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")


def gpt_flags(shape, pp, iterations):
    return [
        "--num-layers", shape["layers"], "--hidden-size", shape["hidden"], "--num-attention-heads", shape["heads"],
        "--seq-length", shape["seq"], "--max-position-embeddings", shape["seq"],
        "--micro-batch-size", shape["micro_batch"],
        "--global-batch-size", shape["micro_batch"] * shape["micro_batches"],
        "--pipeline-model-parallel-size", pp, "--synthetic-vocab-size", shape["vocab"],
        "--make-vocab-size-divisible-by", 8, "--hidden-dropout", 0, "--attention-dropout", 0,
        "--untie-embeddings-and-output-weights", "--lr", 1e-4, "--train-iters", iterations, "--eval-iters", 0,
        "--log-interval", 1, "--seed", 1234,
    ]


def launch(shape, pp, iterations, partition_flags, out_dir):
    """pretrain_gpt.py on pp ranks, its last iteration profiled into out_dir; returns ({iteration: ms}, report)."""
    command = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(pp), "--master_port",
               str(free_port()), str(REPO / "pretrain_gpt.py")]
    command += [str(flag) for flag in gpt_flags(shape, pp, iterations) + partition_flags]
    command += ["--profile-flops-step", str(iterations), "--profile-flops-output", str(out_dir)]
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    process = subprocess.run(command, cwd=out_dir, env=env, capture_output=True, text=True)
    if process.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{process.stdout[-3000:]}\n{process.stderr[-3000:]}")
    times = {int(m.group(1)): float(m.group(2)) for m in _ITERATION.finditer(process.stdout)}
    report = json.loads((out_dir / f"flops_profile_step{iterations}.json").read_text())
    return times, report


def steady_ms(times, warmup, iterations):
    """The median iteration time after the warm-up, before the counting and the profiled iterations."""
    return statistics.median(ms for it, ms in times.items() if warmup < it < iterations - 1)


def measure(shape, pp, rounds, iterations, warmup, work):
    print(f"pp {pp}: profiling the default partition ...", flush=True)
    _, report = launch(shape, pp, iterations, ["--pp-partition-method", DEFAULT], work / f"pp{pp}_profile")
    plan_path = work / f"pp{pp}_profile" / f"flops_profile_step{iterations}.json"
    plan = report["partition_plan"]
    runs = {name: ["--pp-partition-method", method] for name, method in METHODS.items()}
    runs[PLANNED] = ["--pp-partition-from-profile", str(plan_path)]
    measured = {name: [] for name in runs}
    parts, predictions = {}, []
    for round_ in range(rounds):
        for name, flags in runs.items():
            out = work / f"pp{pp}_round{round_}_{list(runs).index(name)}"
            times, run_report = launch(shape, pp, iterations, flags, out)
            measured[name].append(steady_ms(times, warmup, iterations))
            parts[name] = run_report["partition_plan"]["current_parts"]
            if name == DEFAULT_NAME:  # its profile predicts the plan anew, from this round's measurement
                predictions.append(plan_of(run_report, cut_at=plan["parts"])["predicted_iter_s"] * 1000)
            print(f"  round {round_ + 1}/{rounds} {name}: parts {parts[name]}, "
                  f"{measured[name][-1]:.1f} ms", flush=True)
    return plan, parts, measured, predictions


def print_results(pp, plan, parts, measured, predictions, shape):
    """One table: each partition's median; the plan's prediction, from the profiled run and from every round's
    default run (the median of those), against the plan's measured median."""
    default_ms = statistics.median(measured[DEFAULT_NAME])
    planned_ms = statistics.median(measured[PLANNED])
    rows = []
    for name, times in measured.items():
        ms = statistics.median(times)
        rows.append([name, str(parts[name]), f"{ms:.1f}", f"{ms / default_ms:.3f}"])
    profiled = plan["predicted_iter_s"] * 1000
    print(f"\npp {pp}, {len(measured[PLANNED])} rounds; shape {shape}")
    print(table(["partition", "parts", "median ms/iter", "/ default"], rows))
    print(f"the plan {plan['parts']}, predicted by the profiled run (its default partition measured "
          f"{plan['measured_iter_s'] * 1000:.1f} ms): {profiled:.1f} ms ({profiled / planned_ms - 1:+.1%} off the "
          f"plan's measured {planned_ms:.1f} ms)")
    median = statistics.median(predictions)
    print(f"predicted by each round's default run: median {median:.1f} ms ({median / planned_ms - 1:+.1%} off), "
          f"from {min(predictions):.1f} to {max(predictions):.1f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=12, help="per launch, the last profiled")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the tiny GPT at pp 2, one round: a smoke run")
    args = parser.parse_args()
    shape, pps, rounds, iterations, warmup = UNBALANCED, args.pp, args.rounds, args.iterations, args.warmup
    if args.quick:
        shape, pps, rounds, iterations, warmup = TINY, [2], 1, 5, 1
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory(prefix="partition_speedup_") as work:
        for pp in pps:
            plan, parts, measured, predictions = measure(shape, pp, rounds, iterations, warmup, Path(work))
            print_results(pp, plan, parts, measured, predictions, shape)
    print(f"after: {load()}")


if __name__ == "__main__":
    main()
