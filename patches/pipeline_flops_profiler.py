"""Make DeepSpeed's `flops_profiler` config section work under pipeline parallelism (DeepSpeed 0.19.x).

What 0.19.8 does (shared/notes/deepspeed-facts.md): the section starts DeepSpeed's FlopsProfiler on
global rank 0 only, prints it only from DeepSpeedEngine.step(), which PipelineEngine never calls,
and, by forcing the wall-clock timers on, crashes every stage but the last ("bwd_microstep timer has
already been started": _exec_backward_pass starts the backward timers, then the engine's own
backward prologue starts them again).

What these patches change, on PipelineEngine only:
1. The engine's own FlopsProfiler is never started on a pipeline (flops_profiler_enabled() is
   False there); the section is read directly instead.
2. train_batch, at the section's profile_step (DeepSpeed's meaning: the batch that starts when
   global_steps == profile_step), runs the batch under PipelineFlopsProfiler on every rank of every
   stage, then prints one gathered report from global rank 0, honouring module_depth, top_modules,
   detailed and output_file.
3. The backward prologue and epilogue leave alone the timers the pipeline instruction already runs.
"""
from deepspeed.runtime.pipe.engine import PipelineEngine

_state = {"flag_step": None}


def yield_to_flag(profile_step):
    """--profile-flops-step was given: it wins over the config section (the caller logs that)."""
    _state["flag_step"] = profile_step


def install():
    PipelineEngine.flops_profiler_enabled = _pipeline_flops_profiler_enabled
    PipelineEngine._start_timers = _start_timers_once
    PipelineEngine._stop_timers = _stop_own_timers
    PipelineEngine.train_batch = _profiling_train_batch(PipelineEngine.train_batch)


def _pipeline_flops_profiler_enabled(self):
    return False


_engine_start_timers = PipelineEngine._start_timers
_engine_stop_timers = PipelineEngine._stop_timers


def _start_timers_once(self, timer_names):
    left_to_owner = self.__dict__.setdefault("_timers_left_to_owner", set())
    to_start = []
    for name in timer_names:
        if self.timers(name).started_:
            left_to_owner.add(name)  # the running instruction started it and will stop it
        else:
            to_start.append(name)
    _engine_start_timers(self, to_start)


def _stop_own_timers(self, timer_names):
    left_to_owner = self.__dict__.get("_timers_left_to_owner", set())
    to_stop = [name for name in timer_names if name not in left_to_owner]
    left_to_owner.difference_update(timer_names)
    _engine_stop_timers(self, to_stop)


def _profiling_train_batch(original_train_batch):
    def train_batch(self, data_iter=None):
        config = self._config.flops_profiler_config
        if not config.enabled or self.global_steps != config.profile_step:
            return original_train_batch(self, data_iter)
        if _state["flag_step"] is not None:  # the flag wins; training logged it at start
            return original_train_batch(self, data_iter)
        from megatron.profiler import PipelineFlopsProfiler

        profiler = PipelineFlopsProfiler(self)
        profiler.start_profile()
        try:
            loss = self.train_batch(data_iter)  # the profiler's timed wrapper around the original
        finally:
            profiler.stop_profile()
        profiler.print_model_profile(profile_step=config.profile_step, module_depth=config.module_depth,
                                     top_modules=config.top_modules, detailed=config.detailed,
                                     output_file=config.output_file)
        profiler.end_profile()
        return loss

    train_batch.__wrapped__ = original_train_batch
    return train_batch
