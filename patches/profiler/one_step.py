"""`--profile-flops-step N`: one training iteration profiled on every rank, its report printed and written.

Shared by every Megatron that profiles through the patch set (our GPT fork, and upstream Megatron-DeepSpeed
through patches.megatron_upstream), so the same flag gives the same report and the same files.
"""
import functools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from patches.profiler.files import write_tensorboard_scalars
from patches.profiler.perturbation import IterationClock, Perturbation, apply_perturbation
from patches.profiler.pipeline_profiler import CountingPass, PipelineFlopsProfiler, ReportWriteError, count_iteration

StepResult = TypeVar("StepResult")


@dataclass(frozen=True)
class StepProfileRequest:
    """What --profile-flops-step asks for one iteration."""
    step: int
    output_dir: str
    seq_length: Optional[int] = None
    analytic: Optional[dict] = None  # the Megatron-LM formula's {'fwd_flops', 'bwd_flops', 'recompute_flops'}
    peak_tflops: Optional[float] = None
    activation_checkpointing: Optional[bool] = None  # None: the profiler reads it off a PipelineModule
    recompute_note: Optional[str] = None  # the report's line on layers recomputed short of the flags
    # The unprofiled iterations' median wall time (IterationClock, the caller's loop) and which they were;
    # None: the report's rates come from the profiled iteration itself.
    unprofiled_iter_s: Optional[float] = None
    unprofiled_iterations: Optional[List[int]] = None
    log_line_flops: Optional[float] = None  # the training log line's FLOPs of one iteration (its formula)
    # The FLOPs of the iteration before (count_train_step); None: counted in the profiled iteration itself.
    counting_pass: Optional[CountingPass] = None

    @property
    def json_path(self) -> str:
        return os.path.join(self.output_dir, f"flops_profile_step{self.step}.json")

    @property
    def trace_path(self) -> str:
        return os.path.join(self.output_dir, f"pipeline_trace_step{self.step}.json")


def count_train_step(engine: DeepSpeedEngine, step: int, run_step: Callable[[], StepResult],
                     clock: IterationClock) -> Tuple[StepResult, CountingPass]:
    """The iteration before the profiled one: its FLOPs counted on this rank (no collective), for the
    profiled iteration's request (StepProfileRequest.counting_pass). Timed on `clock`, and marked there as
    perturbed: never an unprofiled baseline. Returns (run_step's result, the pass)."""
    try:
        return clock.timed(step, functools.partial(count_iteration, engine, step, run_step))
    finally:
        clock.mark_perturbed(step)


def profile_train_step(engine: DeepSpeedEngine, request: StepProfileRequest, run_step: Callable[[], StepResult],
                       tensorboard_writer: Any = None) -> StepResult:
    """Run one iteration (run_step) profiled on every rank; global rank 0 prints the report and writes the JSON
    and, beside it, the Chrome trace; a TensorBoard writer (where the rank has one) gets the headline scalars.
    Collective: every rank of the run calls it for the same iteration."""
    profiler = PipelineFlopsProfiler(engine, seq_length=request.seq_length, analytic=request.analytic,
                                     peak_tflops=request.peak_tflops,
                                     activation_checkpointing=request.activation_checkpointing,
                                     recompute_note=request.recompute_note, counting_pass=request.counting_pass)
    profiler.start_profile()
    start = time.time()  # the clock of the unprofiled iterations (IterationClock)
    try:
        result = run_step()
    finally:
        profiled_s = time.time() - start
        profiler.stop_profile()
    # Global rank 0's times, as rank 0 builds the report; every rank applies them to its copy of it.
    perturbation = [Perturbation(profiled_s, request.unprofiled_iter_s, list(request.unprofiled_iterations or []),
                                 request.log_line_flops)]
    dist.broadcast_object_list(perturbation, src=0)
    apply_perturbation(profiler.get_report(profile_step=request.step), perturbation[0])
    profiler.print_model_profile(profile_step=request.step)
    try:
        # files.write_json makes the directory on rank 0: its failure, too, reaches every rank
        profiler.write_json(request.json_path)
        profiler.write_trace(request.trace_path)
    except ReportWriteError as error:  # every rank has it: training goes on, unprofiled, on every rank
        if dist.get_rank() == 0:
            print(f"warning: {error}; training goes on", file=sys.stderr, flush=True)
    if tensorboard_writer is not None:
        write_tensorboard_scalars(profiler.get_report(), tensorboard_writer, request.step)
    profiler.end_profile()
    return result
