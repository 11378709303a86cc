"""The flops_profiler section no longer switches DeepSpeed's wall-clock timers on (DeepSpeed 0.19.x).

DeepSpeed gap closed: 0.19.8's DeepSpeedConfig sets `wall_clock_breakdown = <user's key> | flops_profiler.enabled`,
and PipelineEngine._exec_optimizer_step then computes `global_steps % steps_per_print()`, which is None by
default: the section alone crashes every rank. Our profiler times the step itself and never reads those
timers, so an engine whose section is on sees exactly the wall_clock_breakdown the user wrote.
"""
import functools

import deepspeed.runtime.config as ds_config
from deepspeed.runtime.engine import DeepSpeedEngine

WHAT_IT_FIXES = "the flops_profiler section switching wall_clock_breakdown on"


def requires():
    return [(DeepSpeedEngine, "wall_clock_breakdown"), (ds_config, "get_wall_clock_breakdown")]


def install():
    original = DeepSpeedEngine.wall_clock_breakdown

    @functools.wraps(original)
    def wall_clock_breakdown(self):
        """DeepSpeed bug: the section forces the timers on, and a pipeline then crashes on steps_per_print None."""
        if not self._config.flops_profiler_config.enabled:
            return original(self)
        return bool(ds_config.get_wall_clock_breakdown(self._config._param_dict))

    DeepSpeedEngine.wall_clock_breakdown = wall_clock_breakdown
