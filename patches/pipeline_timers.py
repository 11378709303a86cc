"""PipelineEngine's wall-clock timers started twice, fixed for profiled engines (DeepSpeed 0.19.x).

DeepSpeed bug closed: with wall_clock_breakdown, PipelineEngine._exec_backward_pass starts the backward
timers and the engine's own backward prologue starts them again: "bwd_microstep timer has already been
started" on every stage but the last. The prologue and epilogue now leave alone a timer the running
pipeline instruction already started. Only engines whose flops_profiler section is on, or that a
PipelineFlopsProfiler is profiling, are changed; any other engine runs DeepSpeed's own code.
"""
import weakref

from deepspeed.runtime.pipe.engine import PipelineEngine

from patches.flops_profiler_config import wants_profiler
from patches.profiler.measurement import ACTIVE

# Per engine, the timers a running pipeline instruction started (kept off the engine: profiling leaves
# no attribute behind).
_LEFT_TO_OWNER = weakref.WeakKeyDictionary()

WHAT_IT_FIXES = "PipelineEngine's backward timers started twice under wall_clock_breakdown"

_engine_start_timers = _engine_stop_timers = None


def requires():
    return [(PipelineEngine, "_start_timers"), (PipelineEngine, "_stop_timers")]


def install():
    global _engine_start_timers, _engine_stop_timers
    _engine_start_timers, _engine_stop_timers = PipelineEngine._start_timers, PipelineEngine._stop_timers
    PipelineEngine._start_timers = _start_timers_once
    PipelineEngine._stop_timers = _stop_own_timers


def _timers_fixed_for(engine):
    """Engines whose section is on, or that a PipelineFlopsProfiler is profiling; others run DeepSpeed's own."""
    return wants_profiler(engine) or engine.__dict__.get(ACTIVE, False)


def _start_timers_once(self, timer_names):
    """DeepSpeed bug: with wall_clock_breakdown, _exec_backward_pass starts the backward timers and the
    engine's backward prologue starts them again ("timer has already been started")."""
    if not _timers_fixed_for(self):
        return _engine_start_timers(self, timer_names)
    left_to_owner = _LEFT_TO_OWNER.setdefault(self, set())
    to_start = []
    for name in timer_names:
        if self.timers(name).started_:
            left_to_owner.add(name)  # the running instruction started it and will stop it
        else:
            to_start.append(name)
    _engine_start_timers(self, to_start)


def _stop_own_timers(self, timer_names):
    """The other half of _start_timers_once: a timer the running instruction started is left to it."""
    if not _timers_fixed_for(self):
        return _engine_stop_timers(self, timer_names)
    left_to_owner = _LEFT_TO_OWNER.get(self, set())
    to_stop = [name for name in timer_names if name not in left_to_owner]
    left_to_owner.difference_update(timer_names)
    _engine_stop_timers(self, to_stop)
