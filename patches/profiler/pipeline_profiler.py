"""PipelineFlopsProfiler: DeepSpeed's FlopsProfiler API, made true for PipelineEngine (and DeepSpeedEngine).

    prof = PipelineFlopsProfiler(engine)
    prof.start_profile()
    engine.train_batch(data_iter)        # or forward/backward/step on a plain DeepSpeedEngine
    prof.stop_profile()
    prof.print_model_profile(profile_step=N)   # collective: every rank calls it; rank 0 prints
    report = prof.get_report()                 # collective; the same dict on every rank
    prof.write_json(path); prof.write_trace(path)   # collective; rank 0 writes
    prof.end_profile()

Every rank of every stage measures its own stage (measurement.py): forward, backward and recompute FLOPs
and latencies per module, and every schedule instruction. get_report gathers the reported replica's
measurements (and a few timings of every rank) to global rank 0, which builds the report and broadcasts
it (sources.GatheredReports, gather.py: the cost does not grow with data parallelism); only global rank 0
prints and writes files. The replica's clocks are aligned to rank 0's (gather.measure_clock_offset), so
that the stages' events share one time line: the bubble analysis and the Chrome trace (trace.py) use it.
"""
from typing import Any, Optional

from deepspeed.runtime.engine import DeepSpeedEngine

from patches.profiler.api import ProfilerAPI
from patches.profiler.context import RunDescription
from patches.profiler.measurement import StageMeasurement
from patches.profiler.sources import GatheredReports, ReportWriteError

__all__ = ["PipelineFlopsProfiler", "ReportWriteError"]


class PipelineFlopsProfiler(ProfilerAPI):
    """DeepSpeed's FlopsProfiler API, collective: see the module docstring."""

    def __init__(self, engine: DeepSpeedEngine, run: Optional[RunDescription] = None, **description: Any):
        """run, or its fields as keywords (seq_length=..., analytic=..., peak_tflops=...): what the caller knows
        of the run, for the report's optional lines (context.RunDescription). Neither: what the Megatron of the
        engine's training loop says of it (sources.describe_run), when the report is built."""
        if run is None and description:
            run = RunDescription(**description)
        measurement = StageMeasurement(engine)
        super().__init__(measurement, GatheredReports(measurement, run))
