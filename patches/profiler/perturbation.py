"""What profiling did to the profiled iteration, and the report's rates taken from an unprofiled one.

The profiler's hooks slow the iteration they measure, so rates computed from it understate the run.
The training loop times every iteration on one clock (IterationClock: wall time around the train
step, read from time.time() as the training log line's time is); the report then states the profiled
iteration's time, the median of the unprofiled ones before it and their ratio, and takes achieved
TFLOPs, samples/s and MFU from the unprofiled time (apply_perturbation). Beside them it puts the
training log line's TFLOPs for that same time, and why the two differ.
"""
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple, TypeVar

Result = TypeVar("Result")

# Unprofiled iterations the median is taken over: the last ones before the profiled iteration.
WINDOW = 5
CLOCK = "wall time (time.time()) around the train step, global rank 0"


COUNTING_CHOICES = ("previous", "profiled")
COUNTING_HELP = ("where --profile-flops-step counts FLOPs: 'previous' (default): in the iteration before, with a "
                 "dispatch mode, so that the profiled iteration runs without one (its module calls are checked "
                 "against the counted ones); 'profiled': in the profiled iteration itself (for a model whose "
                 "iterations differ in shape; the profiled iteration runs slower)")


def counts_before(profile_step: Optional[int], counting: str, step: int) -> bool:
    """Whether iteration `step` is the counting pass of --profile-flops-step (it runs just before it)."""
    return profile_step is not None and counting == "previous" and step == profile_step - 1


def counting_announcement(profile_step: int, counting: str, first_done: Optional[int]) -> str:
    """The start-up line's tail: where the FLOPs will be counted. first_done: iterations done before this run
    (a resumed run cannot count in an iteration it does not run); None where not known yet."""
    if counting != "previous" or profile_step == 1 or (first_done is not None and profile_step - 1 <= first_done):
        return ", its FLOPs counted in it"
    if first_done is None:
        return (f", its FLOPs counted in iteration {profile_step - 1} (in it if this run starts at iteration "
                f"{profile_step})")
    return f", its FLOPs counted in iteration {profile_step - 1}"


class IterationClock:
    """Wall seconds of each iteration this process ran, by iteration number."""

    def __init__(self):
        self.seconds: Dict[int, float] = {}
        self.first: Optional[int] = None  # the process's first iteration: its time includes warm-up
        self.perturbed: Set[int] = set()  # iterations slowed by the profiler (its counting pass): never a baseline

    def timed(self, iteration: int, step: Callable[[], Result]) -> Result:
        start = time.time()
        try:
            return step()
        finally:
            self.record(iteration, time.time() - start)

    def record(self, iteration: int, seconds: float) -> None:
        self.seconds[iteration] = seconds
        if self.first is None:
            self.first = iteration
        self.seconds.pop(iteration - 2 * WINDOW, None)  # only the recent ones are ever read

    def mark_perturbed(self, iteration: int) -> None:
        self.perturbed.add(iteration)

    def unprofiled_before(self, step: int) -> Tuple[Optional[float], List[int]]:
        """(median seconds, the iterations it is taken over): up to WINDOW iterations before `step`, leaving
        out the perturbed ones and the process's first (warm-up) unless it is the only one; (None, []) when
        there is none."""
        ran = sorted(i for i in self.seconds if i < step and i not in self.perturbed)
        if len(ran) > 1 and ran[0] == self.first:
            ran = ran[1:]
        ran = ran[-WINDOW:]
        if not ran:
            return None, []
        return statistics.median(self.seconds[i] for i in ran), ran


@dataclass(frozen=True)
class Perturbation:
    """The profiled iteration against unprofiled ones of the same run, on one clock."""
    profiled_iter_s: float
    unprofiled_iter_s: Optional[float]  # None: no unprofiled iteration ran before the profiled one
    unprofiled_iterations: List[int] = field(default_factory=list)
    # The training log line's FLOPs of one iteration (its formula, whole global batch); None where unknown.
    log_line_flops: Optional[float] = None
    clock: str = CLOCK

    def as_dict(self) -> dict:
        return asdict(self)


def apply_perturbation(report: dict, perturbation: Perturbation) -> dict:
    """Put `perturbation` in the report (in place) and take the totals' rates from the unprofiled time.

    report: build_report's dict. Sets report['perturbation'] and, where an unprofiled time is known,
    recomputes totals' tflops_per_gpu, model_tflops_per_gpu, samples_per_s, tokens_per_s and mfu, and each
    stage's tflops_per_gpu, with it (the formulas of build_report, with that time in place of iter latency)."""
    totals, par = report["totals"], report["parallelism"]
    pp, tp, dp, world = (par["pipeline_parallel_size"], par["tensor_parallel_size"], par["data_parallel_size"],
                         par["world_size"])
    unprofiled = perturbation.unprofiled_iter_s
    measured = totals["fwd_flops"] + totals["bwd_flops"] + totals["recompute_flops"]
    out = perturbation.as_dict()
    out["ratio"] = perturbation.profiled_iter_s / unprofiled if unprofiled else None
    out["log_line_tflops"] = None
    out["log_line_note"] = None
    if unprofiled:
        totals["throughput_iter_s"] = unprofiled
        totals["throughput_basis"] = "unprofiled"
        totals["tflops_per_gpu"] = measured / unprofiled / (pp * tp) / 1e12
        totals["model_tflops_per_gpu"] = (totals["fwd_flops"] + totals["bwd_flops"]) / unprofiled / (pp * tp) / 1e12
        totals["samples_per_s"] = par["micro_batches"] * par["micro_batch_size"] * dp / unprofiled
        seq = par.get("seq_length")
        totals["tokens_per_s"] = totals["samples_per_s"] * seq if seq else None
        peak = totals.get("peak_tflops")
        totals["mfu"] = totals["model_tflops_per_gpu"] / peak if peak else None
        for stage in report["stages"]:
            stage_flops = stage["fwd_flops"] + stage["bwd_flops"] + stage["recompute_flops"]
            stage["tflops_per_gpu"] = stage_flops / unprofiled / tp / 1e12
        if perturbation.log_line_flops is not None:
            out["log_line_tflops"] = perturbation.log_line_flops / (unprofiled * world) / 1e12
            out["log_line_note"] = log_line_note(out["log_line_tflops"], totals["tflops_per_gpu"],
                                                 perturbation.log_line_flops, measured * dp)
    report["perturbation"] = out
    return report


def log_line_note(log_tflops: float, report_tflops: float, log_flops: float, measured_flops: int) -> str:
    """One line: why the log line's TFLOPs and the report's differ, at the same time and GPU count."""
    return (f"the log line's {log_tflops:.3g} TFLOPs is Megatron-DeepSpeed's formula, {log_flops:.4g} FLOPs per "
            f"iteration of the global batch (backward = 2 x forward; under --checkpoint-activations one more forward "
            f"of every layer; LM head included), over the same time and world size; the report's {report_tflops:.3g} "
            f"counts what the kernels executed, {measured_flops:.4g} FLOPs (every replica, fwd + bwd + recompute), "
            f"so they differ by exactly the ratio of the two counts, {log_flops / measured_flops:.4f}")
