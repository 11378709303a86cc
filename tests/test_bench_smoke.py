"""The benchmarks run end to end in their --quick mode and print their tables (timings not checked):
bench/profiler_overhead.py under the `deepspeed` launcher, bench/report_scaling.py spawning its ranks."""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.launch import REPO, deepspeed_launcher, explain, free_port

pytestmark = pytest.mark.launch


def bench_env():
    """Read when the test runs: conftest.py gives each launching test its own torch extensions directory."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def test_profiler_overhead_quick_under_the_deepspeed_launcher(tmp_path):
    command = [deepspeed_launcher(), "--num_gpus", "2", "--master_port", str(free_port()),
               str(REPO / "bench" / "profiler_overhead.py"), "--quick"]
    process = subprocess.run(command, cwd=tmp_path, env=bench_env(), capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, explain(process)
    # The launcher logs each rank's exit ("[<date>] [INFO] [launch.py...") after the benchmark's last line.
    lines = [line for line in process.stdout.strip().splitlines() if not line.startswith("[")]
    assert re.fullmatch(r"profiled/unprofiled iteration time ratio: \d+\.\d\d", lines[-1]), explain(process)
    out = process.stdout
    for heading in ("== 1. Our profiler", "== 2. Overhead side by side", "== 3. FLOPs of one iteration"):
        assert out.count(heading) == 1, heading
    assert "left behind after end_profile: none on any rank" in out
    for engine, profilers in (("pp=2 PipelineEngine", ("ours (PipelineFlopsProfiler)", "torch FlopCounterMode",
                                                       "torch.profiler with_flops")),
                              ("pp=1 DeepSpeedEngine", ("ours (PipelineFlopsProfiler)", "DeepSpeed FlopsProfiler",
                                                        "torch FlopCounterMode", "torch.profiler with_flops"))):
        for name in profilers:
            # One row in the overhead table, one in the FLOPs table, one verdict line.
            assert len(re.findall(rf"^{re.escape(name)}\s+{re.escape(engine)}\s", out, re.M)) == 2, (name, engine)
            assert out.count(f"- {name} on {engine}: ") == 1, (name, engine)
        # Our FLOPs equal the formula (fwd, recompute) and the executed kernels (bwd) exactly.
        exact = f"- ours (PipelineFlopsProfiler) on {engine}: nothing: fwd and recompute equal the formula exactly"
        assert exact in out


def test_report_scaling_quick_spawned(tmp_path):
    command = [sys.executable, str(REPO / "bench" / "report_scaling.py"), "--quick"]
    process = subprocess.run(command, cwd=tmp_path, env=bench_env(), capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, explain(process)
    out = process.stdout
    real = out[out.index("real runs"):out.index("link costs measured")]
    simulated = out[out.index("simulated from"):out.index("at the end")]
    # dp, ranks: the real pp 2 x dp 1 and dp 2 runs, then the simulated 1,024 and 4,096 ranks
    assert re.findall(r"^(\d+)\s+(\d+)\s", real, re.M) == [("1", "2"), ("2", "4")]
    assert re.findall(r"^(\d+)\s+(\d+)\s", simulated, re.M) == [("512", "1024"), ("2048", "4096")]
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"report bytes received by a non-zero rank, dp 8 over dp 1: (\d+\.\d\d)", last)
    assert match and float(match.group(1)) <= 1.10, last


def test_idle_cost_quick_spawned(tmp_path):
    command = [sys.executable, str(REPO / "bench" / "idle_cost.py"), "--quick"]
    process = subprocess.run(command, cwd=tmp_path, env=bench_env(), capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, explain(process)
    lines = [line for line in process.stdout.strip().splitlines() if not line.startswith("[")]
    assert re.fullmatch(r"patched idle / stock train_batch time ratio: \d+\.\d{3}", lines[-1]), explain(process)


def test_recompute_plan_scaling_quick(tmp_path):
    command = [sys.executable, str(REPO / "bench" / "recompute_plan_scaling.py"), "--quick", "--repeats", "1"]
    process = subprocess.run(command, cwd=tmp_path, env=bench_env(), capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, explain(process)
    line = process.stdout.strip().splitlines()[-1]
    assert re.match(r"24 layers, pp  4: \d+\.\d{3} s per plan .* recompute per stage \[\d+, \d+, \d+, \d+\];", line)
    assert line.endswith("fits: True"), line


def test_kept_forward_quick(tmp_path):
    command = [sys.executable, str(REPO / "bench" / "kept_forward.py"), "--quick"]
    process = subprocess.run(command, cwd=tmp_path, env=bench_env(), capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, explain(process)
    ratios = re.findall(r"the checkpointed forward / the kept one: x(\d+\.\d\d); recomputing adds [+-]\d+\.\d ms, "
                        r"the plan from a run without recompute prices it at \+(\d+\.\d) ms", process.stdout)
    assert len(ratios) == 2, explain(process)  # the fork's shape and upstream's, 2 micro-batches in flight each
