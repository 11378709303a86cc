"""PipelineEngine's wall-clock timers started twice, fixed for profiled engines (DeepSpeed 0.19.x).

DeepSpeed bug closed: with wall_clock_breakdown, PipelineEngine._exec_backward_pass starts the backward
timers and the engine's own backward prologue starts them again: "bwd_microstep timer has already been
started" on every stage but the last. The prologue and epilogue now leave alone a timer the running
pipeline instruction already started. Only engines whose flops_profiler section is on, or that a
PipelineFlopsProfiler is profiling, are changed; any other engine runs DeepSpeed's own code.
"""
import functools

from deepspeed.runtime.pipe.engine import PipelineEngine

from patches.profiler.attachment import attached
from patches.to_deepspeed.flops_profiler_config import wants_profiler

WHAT_IT_FIXES = "PipelineEngine's backward timers started twice under wall_clock_breakdown"


def requires():
    return [(PipelineEngine, "_start_timers"), (PipelineEngine, "_stop_timers")]


def install():
    engine_start_timers, engine_stop_timers = PipelineEngine._start_timers, PipelineEngine._stop_timers

    @functools.wraps(engine_start_timers)
    def _start_timers(self, timer_names):
        """DeepSpeed bug: with wall_clock_breakdown, _exec_backward_pass starts the backward timers and the
        engine's backward prologue starts them again ("timer has already been started")."""
        left_to_instruction = _left_to_instruction(self)
        if left_to_instruction is None:
            return engine_start_timers(self, timer_names)
        to_start = []
        for name in timer_names:
            if self.timers(name).started_:
                left_to_instruction.add(name)  # the running instruction started it and will stop it
            else:
                to_start.append(name)
        engine_start_timers(self, to_start)

    @functools.wraps(engine_stop_timers)
    def _stop_timers(self, timer_names):
        """The other half of _start_timers: a timer the running instruction started is left to it."""
        left_to_instruction = _left_to_instruction(self)
        if left_to_instruction is None:
            return engine_stop_timers(self, timer_names)
        to_stop = [name for name in timer_names if name not in left_to_instruction]
        left_to_instruction.difference_update(timer_names)
        engine_stop_timers(self, to_stop)

    PipelineEngine._start_timers = _start_timers
    PipelineEngine._stop_timers = _stop_timers


def _left_to_instruction(engine):
    """The engine's set of timers left to the running instruction (its attachment's), where the timers are fixed:
    the section is on, or a measurement is attached. None: DeepSpeed's own timers, unchanged."""
    attachment = attached(engine)
    if attachment is None or not (wants_profiler(engine) or attachment.measurement is not None):
        return None
    return attachment.timers_left_to_instruction
