"""What a report says about the run besides what its ranks measured: one frozen object, built once, passed whole.

- RunDescription: what the code asking for the report knows of its run that the engine does not say
  (Megatron's sequence length, its analytic FLOPs, a device peak, its log line's formula);
- IterationTiming: the profiled iteration's wall time against the unprofiled ones before it, as the
  scheduler's clock measured them (iteration_clock.IterationClock);
- ReportContext: those two, the engine's layout and settings, and how the report was collected: everything
  report.build_report reads besides the ranks' entries.
"""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

from patches.profiler.peaks import peak_tflops_for

if TYPE_CHECKING:  # names only: the report and the tools that read reports import this module without DeepSpeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    from patches.profiler.layout import EngineLayout

CLOCK = "wall time (time.time()) around the train step, global rank 0"


@dataclass(frozen=True)
class RunDescription:
    """What the training loop knows of its run; every field may be unknown (None)."""
    seq_length: Optional[int] = None
    analytic: Optional[dict] = None  # the Megatron-LM formula's {'fwd_flops', 'bwd_flops', 'recompute_flops'}
    peak_tflops: Optional[float] = None  # None: the device table's (peaks.py), if the device is in it
    activation_checkpointing: Optional[bool] = None  # None: read off a PipelineModule's interval
    recompute_note: Optional[str] = None  # the report's one line on layers recomputed short of the flags
    log_line_flops: Optional[float] = None  # the training log line's FLOPs of one iteration (its formula)


UNDESCRIBED = RunDescription()  # a run nothing is known of beyond its engine (a plain DeepSpeed script)


@dataclass(frozen=True)
class IterationTiming:
    """The profiled iteration, and the one that counted its FLOPs, against unprofiled ones of the same run, on one
    clock."""
    profiled_iter_s: float
    unprofiled_iter_s: Optional[float]  # None: no unprofiled iteration ran before the profiled one
    unprofiled_iterations: List[int] = field(default_factory=list)
    # the iteration before, where the FLOPs were counted (the report's flops_counting); None: counted in it
    counting_iter_s: Optional[float] = None
    clock: str = CLOCK
    # (slowest - fastest) / median of the unprofiled iterations: how steady the baseline is (None under two)
    unprofiled_spread: Optional[float] = None
    # why the baseline is weaker than steady iterations after the profiled one (one line), or None
    baseline_note: Optional[str] = None


@dataclass(frozen=True)
class ReportContext:
    """Everything build_report reads besides the ranks' entries (and samples)."""
    step: int
    world_size: int
    pipeline_parallel_size: int
    tensor_parallel_size: int
    data_parallel_size: int
    micro_batches: int
    micro_batch_size: int
    activation_checkpointing: bool
    device_name: str
    dtype: str
    peak_tflops: Optional[float]
    run: RunDescription = UNDESCRIBED
    timing: Optional[IterationTiming] = None  # None: the report's rates are the profiled iteration's
    # fp16 loss scaling skips the update of a step whose gradients overflowed: timed, but no update
    optimizer_step_skipped: bool = False
    collection_note: Optional[str] = None  # how the measurements reached the report, where not gathered
    clock_note: Optional[str] = None  # how the ranks' clocks were put on one time line, where no pings ran
    counting_note: Optional[str] = None  # why the FLOPs were counted in the profiled iteration, not the one before
    # the per-stage memory limit the report's partition plan is made under, and where it came from
    # (partition/method.memory_limit: 'flag', 'environment', 'device'); None: none (CPU)
    memory_limit_bytes: Optional[int] = None
    memory_limit_source: Optional[str] = None

    @classmethod
    def of(cls, engine: "DeepSpeedEngine", layout: "EngineLayout", step: int, run: RunDescription = UNDESCRIBED,
           timing: Optional[IterationTiming] = None, skipped_steps_before: int = 0,
           collection_note: Optional[str] = None, clock_note: Optional[str] = None,
           micro_batches: Optional[int] = None, counting_note: Optional[str] = None) -> "ReportContext":
        """micro_batches: those that ran, where the caller counted them (None: the engine's setting)."""
        import torch
        from deepspeed.accelerator import get_accelerator

        if layout.is_pipeline:
            configured = engine.micro_batches
            checkpointing = engine.module.activation_checkpoint_interval > 0
        else:
            configured = engine.gradient_accumulation_steps()
            checkpointing = False
        if run.activation_checkpointing is not None:  # the caller knows better (Megatron's own checkpointing)
            checkpointing = bool(run.activation_checkpointing)
        dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        device = get_accelerator().device_name()
        device_name = torch.cuda.get_device_name() if device == "cuda" else device
        peak = run.peak_tflops if run.peak_tflops is not None else peak_tflops_for(device_name, dtype)
        limit_bytes, limit_source = _memory_limit()
        return cls(step=int(step), world_size=layout.world_size, pipeline_parallel_size=layout.pp,
                   tensor_parallel_size=layout.tp, data_parallel_size=layout.dp,
                   micro_batches=configured if micro_batches is None else micro_batches,
                   micro_batch_size=engine.train_micro_batch_size_per_gpu(), activation_checkpointing=checkpointing,
                   device_name=device_name, dtype=dtype, peak_tflops=peak, run=run, timing=timing,
                   optimizer_step_skipped=getattr(engine, "skipped_steps", 0) > skipped_steps_before,
                   collection_note=collection_note, clock_note=clock_note, counting_note=counting_note,
                   memory_limit_bytes=limit_bytes, memory_limit_source=limit_source)


def _memory_limit():
    """partition/method.memory_limit, for the report's plan; a bad $DS_PIPE_PARTITION_MEMORY_LIMIT (which stops a
    'profile' partition and a Megatron run's flag check) leaves the report's plan without a limit."""
    from patches.partition.method import memory_limit
    from patches.process.errors import PatchConfigError

    try:
        return memory_limit()
    except PatchConfigError:
        return None, None
