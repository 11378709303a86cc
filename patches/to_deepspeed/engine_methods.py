"""One class-level wrapper for each DeepSpeed engine method the patch set needs, installed once, for every engine.

Each runs DeepSpeed's own method and asks the engine's attachment (profiler/attachment.py) what else to do:

- `DeepSpeedEngine.__init__` and `PipelineEngine.__init__`: the engine gets its attachment before DeepSpeed's
  __init__ runs; once the outermost __init__ has returned, what each applied patch does to a new engine runs
  (`when_built`, handed over by patches.apply(): the config section's set-up, the FlopsProfiler registry, the
  ZeRO groups check), and during it the patches' scopes (`during_init`: the true start-up log line).
- `PipelineEngine.train_batch` (a pipeline's iteration), and `DeepSpeedEngine.forward`, `backward` and `step`
  (a plain engine's), in this order:
  1. a measurement is attached (a training loop's --profile-flops-step, the user's FlopsProfiler code,
     PipelineFlopsProfiler): the method runs timed by it; the user's pipeline measurement is then published
     (attachment.publisher), when its train_batch has returned;
  2. else, where the config section serves the engine, its iteration runs through the section's schedule
     (flops_profiler_config.SectionDoor), which may attach a measurement for it;
  3. else DeepSpeed's method alone.
  An engine built before patches.apply() gets its attachment at its first call of these (attachment_of), and
  runs 3.
"""
import contextlib
import functools
from typing import Any, Callable, ContextManager, Sequence

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from patches.profiler.attachment import EngineAttachment, attachment_of

WHAT_IT_FIXES = "the profiler's view of every engine's iterations"

# The plain engine's methods, timed as the pipeline instructions they correspond to.
PLAIN_ENGINE_INSTRUCTIONS = {"forward": "ForwardPass", "backward": "BackwardPass", "step": "OptimizerStep"}


def requires():
    return [(DeepSpeedEngine, "__init__"), (PipelineEngine, "__init__"), (PipelineEngine, "train_batch"),
            *[(DeepSpeedEngine, method) for method in PLAIN_ENGINE_INSTRUCTIONS]]


def install(when_built: Sequence[Callable[[DeepSpeedEngine, EngineAttachment], None]] = (),
            during_init: Sequence[Callable[[DeepSpeedEngine], ContextManager]] = ()) -> None:
    deepspeed_init, pipeline_init = DeepSpeedEngine.__init__, PipelineEngine.__init__

    @functools.wraps(deepspeed_init)
    def deepspeed_engine_init(self, *args, **kwargs):
        attachment = attachment_of(self)
        with contextlib.ExitStack() as scopes:
            for scope in during_init:
                scopes.enter_context(scope(self))
            deepspeed_init(self, *args, **kwargs)
        if not attachment.runs_a_schedule:  # a PipelineEngine is built when its own __init__ returns
            for built in when_built:
                built(self, attachment)

    @functools.wraps(pipeline_init)
    def pipeline_engine_init(self, *args, **kwargs):
        pipeline_init(self, *args, **kwargs)  # (DeepSpeedEngine.__init__ runs inside it)
        attachment = attachment_of(self)
        for built in when_built:
            built(self, attachment)

    DeepSpeedEngine.__init__ = deepspeed_engine_init
    PipelineEngine.__init__ = pipeline_engine_init
    PipelineEngine.train_batch = _train_batch(PipelineEngine.train_batch)
    DeepSpeedEngine.forward = _plain_engine_method(DeepSpeedEngine.forward, "ForwardPass", opens_iteration=True)
    DeepSpeedEngine.backward = _plain_engine_method(DeepSpeedEngine.backward, "BackwardPass")
    DeepSpeedEngine.step = _plain_engine_method(DeepSpeedEngine.step, "OptimizerStep", may_close_iteration=True)


def _train_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def train_batch(self, *args, **kwargs):
        attachment = attachment_of(self)
        run = functools.partial(_measured_train_batch, attachment, original, self, args, kwargs)
        if attachment.measurement is None and attachment.section is not None:
            return attachment.section.run_batch(self, run)
        return run()

    return train_batch


def _measured_train_batch(attachment: EngineAttachment, original, engine, args, kwargs):
    """train_batch, timed by the attached measurement (read when the batch starts: a schedule attaches it)."""
    measurement = attachment.measurement
    if measurement is None:
        return original(engine, *args, **kwargs)
    try:
        return measurement.time_train_batch(functools.partial(original, engine, *args, **kwargs))
    finally:
        publisher, attachment.publisher = attachment.publisher, None
        if publisher is not None:  # the user's FlopsProfiler code: its stage's part goes to the store now
            publisher.publish()


def _plain_engine_method(original: Callable[..., Any], instruction: str, opens_iteration: bool = False,
                         may_close_iteration: bool = False) -> Callable[..., Any]:
    """forward, backward or step of a plain engine: timed as `instruction` while a measurement is attached. The
    config section's iteration opens at its first forward and closes at the step that advances global_steps (a
    gradient accumulation boundary): the section's door decides (it leaves alone a step the user is measuring).
    A PipelineEngine calls DeepSpeedEngine.forward inside its ForwardPass
    instruction, which its measurement times already: it runs as it is."""
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        attachment = attachment_of(self)
        if attachment.runs_a_schedule:
            return original(self, *args, **kwargs)
        section = attachment.section
        if opens_iteration and section is not None:
            section.before_forward(self)
        steps_before = self.global_steps
        measurement = attachment.measurement
        try:
            if measurement is None:
                result = original(self, *args, **kwargs)
            else:
                result = measurement.time_call(instruction, functools.partial(original, self, *args, **kwargs))
        except BaseException:
            if section is not None:  # the section's iteration ends here: nothing of it stays attached
                section.abandon()
            raise
        if may_close_iteration and section is not None and self.global_steps != steps_before:
            section.after_step(self)
        return result

    return method
