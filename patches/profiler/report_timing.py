"""What the report's times rest on: the profiled iteration against the unprofiled ones of the same run
(`perturbation`, with the training log line's TFLOPs beside the report's), whether it was still warming up, and the
plan's basis (`plan_basis`: the measured times scaled to the steady iterations)."""
from typing import Optional

from patches.partition.measured_run import Basis
from patches.partition.planner import SharedCpus
from patches.profiler.context import IterationTiming, ReportContext

# A profiled iteration this much slower than the steady unprofiled ones was still warming up (the profiler's own
# cost is a few percent: docs/benchmarks.md).
WARMING_UP_RATIO = 1.10


def plan_basis(timing: Optional[IterationTiming], paused_s: float = 0.0,
               shared_cpus: Optional[SharedCpus] = None) -> Basis:
    """What the plan's times rest on: scaled from the profiled iteration to the steady unprofiled ones where the
    baseline is steady; unscaled, and said, where it is not (warm-up alone, or none). paused_s: the garbage
    collector's pauses in the profiled iteration (the most of any stage's), out of the layers' times, and so out of
    the profiled iteration they are scaled from. shared_cpus: where the ranks shared too few CPUs (shared_cpus.py)."""
    if timing is None:
        return Basis(note="no iteration was timed unprofiled", shared_cpus=shared_cpus)
    unprofiled = timing.unprofiled_iter_s
    if timing.baseline_note is not None or not unprofiled:
        return Basis(iterations=tuple(timing.unprofiled_iterations), spread=timing.unprofiled_spread,
                     note=timing.baseline_note or "no iteration was timed unprofiled", shared_cpus=shared_cpus)
    return Basis(unprofiled / _without_pauses(timing, paused_s), tuple(timing.unprofiled_iterations),
                 timing.unprofiled_spread, shared_cpus=shared_cpus)


def _without_pauses(timing, paused_s):
    """The profiled iteration less the collector's pauses in it. (A guard keeps at least half of it: the pauses are
    another rank's, over its measuring window, which holds more than the iteration rank 0 timed.)"""
    return max(timing.profiled_iter_s - paused_s, timing.profiled_iter_s / 2)


def _warming_up_note(timing, paused_s) -> Optional[str]:
    unprofiled = timing.unprofiled_iter_s
    profiled = _without_pauses(timing, paused_s)
    if not unprofiled or timing.baseline_note is not None or profiled <= WARMING_UP_RATIO * unprofiled:
        return None
    without = f" without the garbage collector's {paused_s * 1000:.0f} ms of pauses" if paused_s >= 0.0005 else ""
    return (f"the profiled iteration took {profiled / unprofiled:.2f}x the steady unprofiled ones{without}: it "
            "was still warming up (the profiler's own cost is a few percent); the plan scales its measured times "
            "to the steady iterations")


def perturbation(timing: Optional[IterationTiming], context: ReportContext, report_tflops: float,
                 measured_flops: int, paused_s: float) -> Optional[dict]:
    """The profiled iteration against the unprofiled ones (null without a timing), and the training log line's
    TFLOPs over the same unprofiled time beside the report's, with why they differ."""
    if timing is None:
        return None
    unprofiled = timing.unprofiled_iter_s
    log_flops = context.run.log_line_flops
    log_tflops = log_flops / (unprofiled * context.world_size) / 1e12 if unprofiled and log_flops is not None \
        else None
    counting_s = timing.counting_iter_s
    return {
        "profiled_iter_s": timing.profiled_iter_s,
        "unprofiled_iter_s": unprofiled,
        "unprofiled_iterations": list(timing.unprofiled_iterations),
        "log_line_flops": log_flops,
        "clock": timing.clock,
        "ratio": timing.profiled_iter_s / unprofiled if unprofiled else None,
        "counting_iter_s": counting_s,
        "counting_ratio": counting_s / unprofiled if unprofiled and counting_s is not None else None,
        "log_line_tflops": log_tflops,
        "log_line_note": log_line_note(log_tflops, report_tflops, log_flops, measured_flops)
        if log_tflops is not None else None,
        "unprofiled_spread": timing.unprofiled_spread,
        "baseline_note": timing.baseline_note,
        "warming_up_note": _warming_up_note(timing, paused_s),
    }


def log_line_note(log_tflops: float, report_tflops: float, log_flops: float, measured_flops: int) -> str:
    """One line: why the log line's TFLOPs and the report's differ, at the same time and GPU count."""
    return (f"the log line's {log_tflops:.3g} TFLOPs is Megatron-DeepSpeed's formula, {log_flops:.4g} FLOPs per "
            f"iteration of the global batch (backward = 2 x forward; under --checkpoint-activations one more forward "
            f"of every layer; LM head included), over the same time and world size; the report's {report_tflops:.3g} "
            f"counts what the kernels executed, {measured_flops:.4g} FLOPs (every replica, fwd + bwd + recompute), "
            f"so they differ by exactly the ratio of the two counts, {log_flops / measured_flops:.4f}")
