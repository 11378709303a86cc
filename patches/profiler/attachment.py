"""The one thing the patch set keeps on a DeepSpeed engine: `engine.flops_profiling`, an EngineAttachment.

The class-level wrappers of the engine's methods (patches/to_deepspeed/engine_methods.py,
patches/to_deepspeed/pipeline_timers.py) read it to know what runs on this engine; the doors write to it what they
bring (a run description); a measurement puts itself there while it is attached. It holds no
behaviour: whoever acts on an engine reads it and calls down.
"""
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Set, TypeVar

from deepspeed.runtime.engine import DeepSpeedEngine

from patches.process.registry import REGISTRY
from patches.profiler.context import RunDescription
from patches.profiler.layout import runs_a_schedule

ATTRIBUTE = "flops_profiling"

Result = TypeVar("Result")


class AttachedMeasurement(Protocol):
    """What the engine's method wrappers ask of the measurement attached (measurement.StageMeasurement)."""

    def time_train_batch(self, train_batch: Callable[[], Result]) -> Result: ...
    def time_call(self, instruction: str, call: Callable[[], Result]) -> Result: ...
    def deferred_backward(self, work: Callable[..., Result]) -> Callable[..., Result]: ...


class Publisher(Protocol):
    """What the train_batch wrapper asks of the user's pipeline profiler (local_sources.PublishedReports)."""

    def publish(self) -> None: ...  # the measured train_batch has returned: its stage's part goes to the store


class IterationRunner(Protocol):
    """What the engine's method wrappers ask of the DeepSpeed config section's door
    (flops_profiler_config.SectionDoor): a PipelineEngine's train_batch, a plain engine's forward ... step."""

    def run_batch(self, engine: DeepSpeedEngine, train_batch: Callable[[], Result]) -> Result: ...
    def before_forward(self, engine: DeepSpeedEngine) -> None: ...
    def after_step(self, engine: DeepSpeedEngine) -> None: ...
    def abandon(self) -> None: ...


@dataclass(eq=False)
class EngineAttachment:
    """What the patch set knows of one engine and has attached to it."""
    ordinal: int  # the n-th engine this process built (every rank builds them in the same order), from 1
    runs_a_schedule: bool  # a PipelineEngine (layout.runs_a_schedule): its iteration is train_batch
    # The measurement attached now (StageMeasurement.start puts itself here, detach takes it away): while it is
    # set, the engine's train_batch (or forward, backward and step) are timed by it.
    measurement: Optional[AttachedMeasurement] = None
    # Publishes the attached measurement when the measured train_batch returns: the user's own FlopsProfiler code
    # on a PipelineEngine (local_sources.PublishedReports); None otherwise.
    publisher: Optional[Publisher] = None
    # The DeepSpeed config's flops_profiler section (flops_profiler_config.SectionDoor), where it serves this
    # engine: None where it is off, or where a training loop's --profile-flops-step took the engine over.
    section: Optional[IterationRunner] = None
    # What the training loop says of the iteration it runs (the Megatron door's description, set as the iteration
    # starts), for the reports built of it, its own and those it does not ask for itself (the config section's,
    # the user's FlopsProfiler code's). None: a run nothing is known of.
    run: Optional[RunDescription] = None
    # The gloo groups of this engine's reports (gather.ReportGroups), made once by the first report: held here,
    # never used here (the report's gather reads them; the clean exit lets them go).
    report_groups: Optional[object] = None
    # Wall-clock timers the running pipeline instruction started, left to it (pipeline_timers.py)
    timers_left_to_instruction: Set[str] = field(default_factory=set)


def attached(engine: object) -> Optional[EngineAttachment]:
    """The engine's attachment; None for an engine built before patches.apply() that nothing attached to since."""
    return getattr(engine, "__dict__", {}).get(ATTRIBUTE)


def attachment_of(engine: DeepSpeedEngine) -> EngineAttachment:
    """The engine's attachment, made on first use (an engine built before patches.apply())."""
    attachment = attached(engine)
    if attachment is None:
        REGISTRY.engines_built += 1
        attachment = EngineAttachment(ordinal=REGISTRY.engines_built, runs_a_schedule=runs_a_schedule(engine))
        engine.__dict__[ATTRIBUTE] = attachment  # not nn.Module's __setattr__: it may run before Module.__init__
        REGISTRY.attachments.add(attachment)
    return attachment
