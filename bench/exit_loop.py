"""Does every door exit clean? Each way into the profiler launched many times under the deepspeed launcher,
counting exit codes and at-exit aborts ("terminate called without an active exception", the launcher's 250).
Not part of CI: a launch takes 10 to 60 s on 2 cores.

    python bench/exit_loop.py --count 20                  # the doors of this checkout's GPT and DeepSpeed
    python bench/exit_loop.py --count 20 --upstream /path/to/Megatron-DeepSpeed \\
        --upstream-python /env-0.19.6/bin/python --upstream-python-016 /env-0.16.9/bin/python

The doors, each a pipeline run on CPU over gloo (pp 2; the section's script pp 3), profiling iteration 2:
- flag:    our pretrain_gpt.py --profile-flops-step 2 (a tiny GPT, activation checkpointing);
- module:  the same under `deepspeed --module patches.launch` (what a user's checkout runs);
- section: a plain DeepSpeed PipelineModule script with the config's flops_profiler section;
- user:    the user's own FlopsProfiler(model[0]) code in our pretrain_gpt.py's train loop;
and, with --upstream (a Megatron-DeepSpeed tree, its megatron/data helpers built), in that tree under
`--module patches.launch`, with tests/upstream_shim first on PYTHONPATH (upstream's CPU gaps, test-only):
- upstream-flag: its pretrain_gpt.py --profile-flops-step 2 (DeepSpeed of --upstream-python);
- upstream-user: the user's FlopsProfiler(model[0]) code around its train_step (--upstream-python);
- upstream-zbh1: --enable-zbh1-pipeline --enable-zbh1-exact-semantics --profile-flops-step 2 (DeepSpeed 0.16,
  --upstream-python-016).
The doors take turns (one launch of each, then again), so load on the machine falls on all alike. Every launch
gets a fresh copy of its environment's prebuilt torch extensions (tests/helpers/torch_extensions.py). A launch
that does not exit 0, or prints "terminate called", keeps its output in --out.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.corpus import MERGE_FILE, VOCAB_FILE, preprocess_demo_corpus  # noqa: E402
from tests.helpers.flags import PP2, TINY_GPT  # noqa: E402
from tests.helpers.launch import free_port, remove_shm_buffers  # noqa: E402
from tests.helpers.torch_extensions import fresh_copy  # noqa: E402

ABORT = "terminate called"
TIMEOUT_S = 900
UPSTREAM_USER_CODE = '''"""Upstream's pretrain_gpt.py with the seed user's FlopsProfiler(model[0]) code."""
import os, runpy, sys
sys.path.insert(0, os.getcwd())
from deepspeed.profiling.flops_profiler import FlopsProfiler
import megatron.training as training
from megatron.core import mpu
from megatron.global_vars import get_args
original = training.train_step

def train_step(*args, **kwargs):
    prof = None
    if get_args().curr_iteration + 1 == 2:
        prof = FlopsProfiler(args[2][0])
        prof.start_profile()
    result = original(*args, **kwargs)
    if prof is not None and mpu.get_data_parallel_rank() == 0 and mpu.is_pipeline_last_stage() \\
            and mpu.get_tensor_model_parallel_rank() == 0:
        prof.print_model_profile(profile_step=2)
        prof.end_profile()
    return result

training.train_step = train_step
sys.argv[0] = os.path.join(os.getcwd(), "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def fork_doors(work):
    """(name, python, launcher arguments, script and its arguments, cwd, extra environment) of our checkout."""
    gpt = TINY_GPT + PP2 + ["--train-iters", "3", "--checkpoint-activations"]
    profiled = gpt + ["--profile-flops-step", "2", "--profile-flops-output", str(work / "profiles")]
    section = work / "ds_section.json"
    section.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                                   "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": -1,
                                                      "top_modules": 1, "detailed": False}}))
    python = sys.executable
    return [
        ("flag", python, [], [REPO / "pretrain_gpt.py"] + profiled, work, {}),
        ("module", python, ["--module", "patches.launch"], [REPO / "pretrain_gpt.py"] + profiled, work, {}),
        ("section", python, [], [REPO / "tests" / "scripts" / "plain_pipeline.py", section], work, {}),
        ("user", python, [], [REPO / "tests" / "scripts" / "pretrain_with_user_profiler.py"] + gpt, work,
         {"USER_PROFILE_STEP": "2", "USER_PROFILE_JSON": str(work / "user_report.json")}),
    ]


def upstream_doors(work, upstream, python, python_016):
    """The doors in an upstream tree (tests/test_upstream_checkout.py's model: 4 layers, hidden 64, seq 32)."""
    data_prefix = preprocess_demo_corpus(work)
    config = work / "ds_upstream.json"
    config.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
                                  "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}))
    flags = [str(a) for a in [
        "--pipeline-model-parallel-size", 2, "--tensor-model-parallel-size", 1, "--num-layers", 4, "--hidden-size", 64,
        "--num-attention-heads", 4, "--seq-length", 32, "--max-position-embeddings", 32, "--micro-batch-size", 1,
        "--global-batch-size", 4, "--train-iters", 3, "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style",
        "constant", "--log-interval", 1, "--eval-iters", 0, "--eval-interval", 1000, "--split", "100,0,0",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE,
        "--data-path", data_prefix, "--distributed-backend", "gloo", "--deepspeed", "--deepspeed_config", config,
        "--seed", 1234, "--no-gradient-accumulation-fusion", "--checkpoint-activations",
        "--deepspeed-activation-checkpointing"]]
    profiled = flags + ["--profile-flops-step", "2", "--profile-flops-output", str(work / "upstream_profiles")]
    user_script = work / "upstream_user_code.py"
    user_script.write_text(UPSTREAM_USER_CODE)
    shim = {"PYTHONPATH": f"{REPO / 'tests' / 'upstream_shim'}:{REPO}"}
    module = ["--module", "patches.launch"]
    doors = [("upstream-flag", python, module, ["pretrain_gpt.py"] + profiled, upstream, shim),
             ("upstream-user", python, module, [user_script] + flags, upstream, shim)]
    if python_016:
        doors.append(("upstream-zbh1", python_016, module,
                      ["pretrain_gpt.py"] + profiled + ["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"],
                      upstream, shim))
    return doors


def launch_once(door, out, index):
    """One launch of a door: {door, rc, aborted, seconds}; the output kept in `out` when it went wrong."""
    name, python, launcher_args, script, cwd, extra_env = door
    port = free_port()
    ranks = 3 if name == "section" else 2  # plain_pipeline.py's PipelineModule has 3 stages
    extensions = fresh_copy(Path(tempfile.mkdtemp(prefix="exit_loop_ext_")), python)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", PYTHONPATH=str(REPO),
               TORCH_EXTENSIONS_DIR=str(extensions))
    env.update(extra_env)  # the upstream doors' PYTHONPATH: the shim first
    command = [str(Path(python).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(port),
               *launcher_args, *[str(part) for part in script]]
    start = time.time()
    try:
        process = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        rc, text = process.returncode, process.stdout + process.stderr
    except subprocess.TimeoutExpired as timeout:
        rc, text = "timeout", f"{timeout.stdout or ''}{timeout.stderr or ''}"
    finally:
        remove_shm_buffers(port)
        shutil.rmtree(extensions, ignore_errors=True)
    aborted = ABORT in text
    if rc != 0 or aborted:
        (out / f"{name}-{index}.log").write_text(" ".join(command) + "\n\n" + str(text))
    return {"door": name, "rc": rc, "aborted": aborted, "seconds": round(time.time() - start, 1)}


def summary(records):
    """Per door: launches, exit codes, launches that printed an abort, median seconds."""
    rows = []
    for name in dict.fromkeys(record["door"] for record in records):
        mine = [record for record in records if record["door"] == name]
        codes = {}
        for record in mine:
            codes[str(record["rc"])] = codes.get(str(record["rc"]), 0) + 1
        rows.append({"door": name, "launches": len(mine), "exit_codes": codes,
                     "aborts": sum(record["aborted"] for record in mine),
                     "median_s": statistics.median(record["seconds"] for record in mine)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20, help="launches of each door")
    parser.add_argument("--doors", nargs="*", default=None, help="only these doors (default: every one)")
    parser.add_argument("--upstream", default=None, help="an upstream Megatron-DeepSpeed tree")
    parser.add_argument("--upstream-python", default=sys.executable,
                        help="the interpreter of an environment with DeepSpeed <= 0.19.6 and this project installed")
    parser.add_argument("--upstream-python-016", default=None, help="the same with DeepSpeed 0.16 (zero-bubble)")
    parser.add_argument("--out", default=None, help="where results and failed launches' output go")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="exit_loop_"))
    out = Path(args.out or work / "results")
    out.mkdir(parents=True, exist_ok=True)
    doors = fork_doors(work)
    if args.upstream:
        doors += upstream_doors(work, args.upstream, args.upstream_python, args.upstream_python_016)
    if args.doors:
        doors = [door for door in doors if door[0] in args.doors]
    records = []
    with open(out / "launches.jsonl", "a") as log:
        for index in range(args.count):
            for door in doors:
                record = launch_once(door, out, index)
                records.append(record)
                log.write(json.dumps(record) + "\n")
                log.flush()
    print(f"{'door':15} {'launches':>8} {'aborts':>6}  exit codes     median s")
    for row in summary(records):
        print(f"{row['door']:15} {row['launches']:8d} {row['aborts']:6d}  {json.dumps(row['exit_codes']):14} "
              f"{row['median_s']:8.1f}")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
