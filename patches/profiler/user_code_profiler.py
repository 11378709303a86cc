"""DeepSpeed's FlopsProfiler as user code drives it, made true for a PipelineEngine.

    prof = FlopsProfiler(model[0])    # after patches.apply(); model[0] a PipelineEngine (or its PipelineModule)
    prof.start_profile()              # on every rank, before the profiled train_batch
    engine.train_batch(data_iter)     # each rank that started measures its stage, and stops when it returns
    prof.print_model_profile(...)     # on any one rank (or several): the whole pipeline
    prof.end_profile()

A rank that started profiles its stage through the next train_batch only: forward, backward and
recompute per module, every schedule instruction timed. When that train_batch returns, the rank
removes every hook and publishes its measurements under its own key of the process group's store;
nothing it does waits for another rank. A rank that asks for the report (any getter, a print,
write_json) reads the other ranks' publications, waiting a bounded time for each: stages that did not
profile are named in one line instead of a report, never waited on forever. No collective is entered,
so no subset of ranks driving this API can leave one half-entered (local_sources.PublishedReports).

On a plain DeepSpeedEngine (engine.flops_profiler, with the config section on) the user's own start /
stop / print, on any ranks, report the calling rank's measurements, as stock DeepSpeed's does
(local_sources.LocalReport). The config section's own profile (flops_profiler_config.py) is gathered
collectively, at a point every rank passes, and then held by engine.flops_profiler (ProfilerAPI.hold).
"""
from typing import Optional

import torch
from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler
from deepspeed.runtime.engine import DeepSpeedEngine

from patches.process.registry import pipeline_engine_of
from patches.profiler.api import ProfilerAPI
from patches.profiler.local_sources import LocalReport, PublishedReports
from patches.profiler.measurement import StageMeasurement
from patches.profiler.sources import ProfileIncomplete

__all__ = ["ProfileIncomplete", "UserCodeFlopsProfiler"]


class UserCodeFlopsProfiler(ProfilerAPI, FlopsProfiler):
    """DeepSpeed's FlopsProfiler API (an instance of it) on any subset of ranks; see the module docstring."""

    def __init__(self, model: torch.nn.Module, ds_engine: Optional[DeepSpeedEngine] = None,
                 recompute_fwd_factor: float = 0.0):
        # an engine profiles itself; a PipelineModule, its engine (the registry's); else the ds_engine given
        engine = model if isinstance(model, DeepSpeedEngine) else pipeline_engine_of(model, ds_engine) or ds_engine
        if not isinstance(engine, DeepSpeedEngine):
            raise TypeError("UserCodeFlopsProfiler profiles a DeepSpeed engine (or a PipelineModule of one); "
                            f"got {type(model).__name__}: use DeepSpeed's FlopsProfiler for a plain module")
        measurement = StageMeasurement(engine)
        source = PublishedReports(measurement) if measurement.attachment.runs_a_schedule else LocalReport(measurement)
        ProfilerAPI.__init__(self, measurement, source)
        # DeepSpeed's FlopsProfiler attributes
        self.model, self.ds_engine, self.recompute_fwd_factor, self.func_patched = model, engine, \
            recompute_fwd_factor, False
