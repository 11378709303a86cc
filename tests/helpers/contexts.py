"""ReportContexts for tests that build reports from synthetic entries: one keyword per thing the test sets."""
from typing import Optional

from patches.profiler.context import IterationTiming, ReportContext, RunDescription


def report_context(step: int, pp: int, tp: int, dp: int, micro_batches: int, micro_batch_size: int,
                   seq_length: Optional[int] = None, activation_checkpointing: bool = False,
                   peak_tflops: Optional[float] = None, analytic: Optional[dict] = None,
                   timing: Optional[IterationTiming] = None, log_line_flops: Optional[float] = None,
                   optimizer_step_skipped: bool = False, recompute_note: Optional[str] = None,
                   counting_note: Optional[str] = None) -> ReportContext:
    run = RunDescription(seq_length=seq_length, analytic=analytic, peak_tflops=peak_tflops,
                         activation_checkpointing=activation_checkpointing, recompute_note=recompute_note,
                         log_line_flops=log_line_flops)
    return ReportContext(step, pp * tp * dp, pp, tp, dp, micro_batches, micro_batch_size, activation_checkpointing,
                         "cpu", "fp32", peak_tflops, run, timing, optimizer_step_skipped, counting_note=counting_note)
