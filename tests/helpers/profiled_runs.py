"""Profiled pretrain_gpt.py runs shared by the trace, plot, comparison, TensorBoard and partition tests.

Each configuration is launched once per test session, by whichever test module asks first (a launch
costs about 20 s on a 2-core machine); the others read its files.
"""
import json
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.flags import PP2, layout
from tests.helpers.launch import TORCHRUN, explain, run_pretrain

PROFILE_STEP = 2
PEAK_TFLOPS = 0.5  # a made-up device peak, so that the report has an MFU on CPU
# pp2_tp1_zero1's --pp-partition-memory-limit: ZeRO's two reduction buckets (2 GB each on CPU, fixed_buffer_bytes)
# put every stage's step peak at about 4 GB whatever its layers, so every cut fits (4.0004 to 4.0008 GB)
MEMORY_LIMIT = "4.5GB"
CONFIGS = {
    # pp=2 x tp=2, 4 micro-batches, activation checkpointing
    "pp2_tp2_checkpointed": (4, layout(pp=2, tp=2) + ["--global-batch-size", "8", "--train-iters", "3",
                                                      "--checkpoint-activations", "--peak-tflops", str(PEAK_TFLOPS)]),
    # the same model and batches, pp=2 x tp=1, no checkpointing, ZeRO stage 1, cut by DeepSpeed's 'parameters'
    # method, 4 iterations saved at 2 and 4 in ckpt/ (test_partition_fork resumes it under other partitions); the
    # report's plan under a memory limit on each stage's predicted peak
    "pp2_tp1_zero1": (2, PP2 + ["--zero-stage", "1", "--train-iters", "4", "--save", "{dir}/ckpt",
                                "--save-interval", "2", "--pp-partition-method", "parameters",
                                "--pp-partition-memory-limit", MEMORY_LIMIT]),
}
_runs = {}


@dataclass
class ProfiledRun:
    output: str  # stdout and stderr of the launch
    report_path: Path
    trace_path: Path
    tensorboard_dir: Path
    directory: Path  # the run's working directory ("{dir}" in CONFIGS)
    losses: dict  # {iteration: loss}

    @property
    def report(self):
        return json.loads(self.report_path.read_text())

    @property
    def trace(self):
        return json.loads(self.trace_path.read_text())


def profiled_run(tmp_path_factory, name):
    """The run of CONFIGS[name], iteration PROFILE_STEP profiled, launched on first use."""
    if name not in _runs:
        nprocs, flags = CONFIGS[name]
        tmp = tmp_path_factory.mktemp(name)
        flags = [flag.format(dir=tmp) for flag in flags]
        flags += ["--profile-flops-step", str(PROFILE_STEP), "--profile-flops-output", tmp / "profile",
                  "--tensorboard-dir", tmp / "tensorboard"]
        process, losses = run_pretrain(tmp, nprocs, flags, name=name, via=TORCHRUN)
        assert process.returncode == 0, explain(process)
        _runs[name] = ProfiledRun(output=process.stdout + process.stderr,
                                  report_path=tmp / "profile" / f"flops_profile_step{PROFILE_STEP}.json",
                                  trace_path=tmp / "profile" / f"pipeline_trace_step{PROFILE_STEP}.json",
                                  tensorboard_dir=tmp / "tensorboard", directory=tmp, losses=losses)
    return _runs[name]
