"""One rank's measurement of its stage: attach to the engine, measure one iteration, detach, and the rank's entry.

    measurement = StageMeasurement(engine)
    measurement.start()          # a ModuleProfiler on the stage module, EngineHooks on the engine; it is the
                                 # engine's attached measurement (attachment.py)
    engine.train_batch(...)      # (or forward / backward / step on a plain DeepSpeedEngine), timed by it
    measurement.stop()
    measurement.entry()          # this rank's RankEntry: local, no collective
    measurement.detach()         # every hook gone: the engine runs as if never profiled

One iteration of a schedule (one_step.ProfileSchedule) in two calls:

    measurement = StageMeasurement.begin(engine, attachment, counted)   # made and started
    finished = measurement.finish()  # stopped, every hook gone: the rank's entry (or the error building it), its
                                     # module events and its iteration's time (the module profiler's results
                                     # read once, its hooks off)

Where the FLOPs come from is decided at start: counted by a dispatch mode in the measured iteration itself,
or taken from a counting pass over the iteration before (one_step.ProfileSchedule), so that the measured iteration runs
without the mode; its module calls are then checked against the counted ones (calls_differ). The stage's memory
(memory.py) is measured with the FLOPs, in the iteration that counts them, on a PipelineEngine.
What the measurements become (a report, gathered or read from the store) is the report sources' job
(sources.py).
"""
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, List, Optional, Tuple, TypeVar, Union

import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine

from patches.partition.layers import stage_layers
from patches.profiler.attachment import EngineAttachment, attachment_of
from patches.profiler.engine_hooks import EngineHooks, synchronized_clock
from patches.profiler.entry import RankEntry
from patches.profiler.fail_safe import MEMORY, FaultLog, MeasurementFault
from patches.profiler.instructions import BACKWARD_INSTRUCTIONS, FORWARD_INSTRUCTIONS
from patches.profiler.layout import EngineLayout
from patches.profiler.memory import MemoryMeasurement, StageMemory
from patches.profiler.module_profiler import ModuleEvent, ModuleProfiler, ModuleResults
from patches.profiler.module_tree import annotate_replicated_params
from patches.profiler.where_it_ran import where_it_ran

Result = TypeVar("Result")


@dataclass(frozen=True)
class FinishedMeasurement:
    """What finish() hands the report source in one piece: the rank's entry (or the error building it raised: a
    collective report still needs this rank's part), when each module ran, and the measured iteration's time."""
    entry: Union[RankEntry, Exception]
    module_events: List[ModuleEvent]
    train_batch_s: float


@dataclass(frozen=True)
class CountingPass:
    """The FLOPs of one iteration, counted by a dispatch mode (count_flops), for the measured iteration after it
    to take instead of counting on its own timed path."""
    iteration: int
    module_profiler: ModuleProfiler  # stopped, hooks removed: its counts stay readable
    memory: Optional[StageMemory] = None  # the stage's memory, measured in the same iteration
    faults: Tuple[MeasurementFault, ...] = ()  # what it could not measure (fail_safe.py)


class StageMeasurement:
    """What one rank measures of its stage over one iteration (see the module docstring)."""

    def __init__(self, engine: DeepSpeedEngine, attachment: Optional[EngineAttachment] = None):
        """attachment: the engine's (attachment.py), where the caller holds it; else looked up (none without an
        engine: a profiler that only holds a report)."""
        self.engine = engine
        if attachment is None and engine is not None:
            attachment = attachment_of(engine)
        self.attachment: Optional[EngineAttachment] = attachment
        # Read at the first start(): DeepSpeed's engine makes its profiler before a PipelineEngine has its grid.
        self.layout: Optional[EngineLayout] = None
        self.accelerator = get_accelerator()
        self.module_profiler: Optional[ModuleProfiler] = None
        self.hooks: Optional[EngineHooks] = None
        self.memory: Optional[MemoryMeasurement] = None  # measuring the memory (in the iteration that counts)
        self.measured_memory: Optional[StageMemory] = None  # what it measured, once stopped
        self.faults = FaultLog()  # what failed of this measurement inside the iteration (fail_safe.py)
        self.counted: Optional[CountingPass] = None
        self.calls_differ: List[str] = []  # modules whose calls differ from the counting pass's
        self._results: Optional[ModuleResults] = None  # the module profiler's, once finish() has read them
        self.skipped_steps_before = 0
        self.started = False
        self._train_batch_s = 0.0  # a PipelineEngine's train_batch, timed (time_train_batch)
        self._window: List[Optional[float]] = [None, None]  # [start, end] of the measured work: a plain engine's

    @classmethod
    def begin(cls, engine: DeepSpeedEngine, attachment: EngineAttachment,
              counted: Optional[CountingPass] = None) -> "StageMeasurement":
        """A measurement of the engine's next iteration, started (start())."""
        measurement = cls(engine, attachment)
        measurement.start(counted=counted)
        return measurement

    def start(self, ignore_list: Optional[Iterable[type]] = None, counted: Optional[CountingPass] = None) -> None:
        """Install every hook and timer, afresh, and become the engine's attached measurement (attachment.py: its
        train_batch, or forward, backward and step, are then timed by this one). Local: no rank waits for another.

        ignore_list: module types left out (DeepSpeed's meaning). counted: the iteration before's FLOPs (None:
        count them in this one)."""
        if self.started:
            return
        self._remove_hooks()  # measured before and not detached: start afresh
        if self.layout is None:
            self.layout = EngineLayout.of(self.engine)
        module = self.engine.module
        self.counted = counted
        if self.accelerator.device_name() != "cpu":
            self.accelerator.reset_peak_memory_stats()
        self.calls_differ = []
        self._results = None
        self.skipped_steps_before = getattr(self.engine, "skipped_steps", 0)
        self.module_profiler = ModuleProfiler.started(module, synchronize=self.accelerator.synchronize,
                                                      root_name=type(module).__name__, ignore_types=ignore_list,
                                                      count_flops=counted is None)
        self.measured_memory = None
        self.faults = FaultLog()
        try:
            self.hooks = EngineHooks.attach(self.engine, self.layout, self.module_profiler,
                                            self.accelerator.synchronize)
            if counted is None and self.layout.is_pipeline:
                self._start_memory()
        except BaseException:
            if self.hooks is not None:
                self.hooks.remove()
            self.module_profiler.remove()
            raise
        self._train_batch_s = 0.0
        self._window = [self._clock(), None]
        self.started = True
        self.attachment.measurement = self

    def stop(self) -> None:
        """Stop measuring; the measurements stay readable, the hooks stay (inert) until detach()."""
        self._end(finish=False)

    def finish(self) -> FinishedMeasurement:
        """The measured iteration's end: the module profiler finishes (stopped, the counting pass's FLOPs taken,
        its hooks off, its results read once), this rank's entry is built from those results, and the engine's
        hooks come off (detach())."""
        events: List[ModuleEvent] = []
        try:
            self._end(finish=True)
            entry, events = self.entry(), self.events()
        except Exception as error:  # reading the module profiler's results: this rank's failure to report
            self.started = False
            entry = error
        self.detach()
        return FinishedMeasurement(entry, events, self.train_batch_s())

    def _end(self, finish: bool) -> None:
        if not self.started:
            return
        self._window[1] = self._clock()
        self._stop_memory()
        counting = self.counted.module_profiler if self.counted is not None else None
        if finish:
            self._results = self.module_profiler.finish(adopt_from=counting)
            self.calls_differ = self._results.calls_differ
        else:
            self.calls_differ = self.module_profiler.stop(adopt_from=counting)
        self.started = False

    def detach(self) -> None:
        """Stop, then remove every hook, wrapper and swapped function: the engine runs as if never measured."""
        self.stop()
        if self.attachment.measurement is self:
            self.attachment.measurement = None
        self._remove_hooks()

    def _start_memory(self) -> None:
        """The stage's memory, measured after the engine hooks are on (it proxies the layers they may have
        swapped) and taken off before them; what fails of it is a fault, never the run's error."""
        layers = None
        with self.faults.guard(MEMORY, "start"):
            layers = stage_layers(self.engine.module, self.layout.stage)
        if self.faults.failed(MEMORY):
            return
        self.memory = MemoryMeasurement.started(self.engine, self.accelerator, layers, self.faults)
        self.hooks.instructions.around = self.memory.instruction_guarded

    def _stop_memory(self) -> None:
        # Its hooks come off first: they proxy what the engine hooks put in place.
        if self.memory is not None:
            memory, self.memory = self.memory, None
            self.hooks.instructions.around = None
            self.measured_memory = memory.stop()

    def _remove_hooks(self) -> None:
        # The measurements stay readable (entry(), the getters); only the attachments go. A finished module
        # profiler has taken its own hooks off (finish()).
        self._stop_memory()
        if self.hooks is not None:
            self.hooks.remove()
        if self.module_profiler is not None and self._results is None:
            self.module_profiler.remove()

    def reset(self) -> None:
        """Zero what was measured so far; measuring, if started, goes on."""
        if self.module_profiler is not None:
            self.module_profiler.reset()
        if self.hooks is not None:
            self.hooks.reset()
        self._train_batch_s = 0.0
        if self.started:
            self._window = [self._clock(), None]

    def _clock(self) -> float:
        return synchronized_clock(self.accelerator.synchronize)

    def time_train_batch(self, train_batch: Callable[[], Result]) -> Result:
        """A PipelineEngine's train_batch, timed (engine_methods.py calls it while this measurement is attached):
        the profiled iteration's time."""
        start = self._clock()
        try:
            return train_batch()
        finally:
            self._train_batch_s += self._clock() - start

    def time_call(self, instruction: str, call: Callable[[], Result]) -> Result:
        """A plain engine's forward, backward or step, timed as the pipeline instruction it corresponds to."""
        return self.hooks.instructions.run(instruction, call)

    def deferred_backward(self, work: Callable[..., Result]) -> Callable[..., Result]:
        """Backward work a schedule defers out of the running module's backward (ModuleProfiler.deferred_backward)."""
        return self.module_profiler.deferred_backward(work) if self.started else work

    @property
    def measured(self) -> bool:
        return self.module_profiler is not None

    def entry(self) -> RankEntry:
        """This rank's measurements (not collective): its module tree (with the replicated parameters marked),
        the instructions as they ran, and what the report says of the counting and of the stage's layers."""
        if self.module_profiler is None:
            raise RuntimeError("start_profile() never ran on this rank: nothing was measured")
        memory = self.counted.memory if self.counted is not None else self.measured_memory
        faults = (self.counted.faults if self.counted is not None else ()) + tuple(self.faults.faults)
        peak = None
        if self.accelerator.device_name() != "cpu":
            peak = int(self.accelerator.max_memory_allocated())
            if self.measured_memory is not None and self.measured_memory.allocator is not None:
                # it reset the peak at each instruction: its own peak is this iteration's
                peak = self.measured_memory.allocator.measured_peak_bytes
        counted = self.counted.iteration if self.counted is not None else None
        module, layout = self.engine.module, self.layout
        measured = self._results if self._results is not None else self.module_profiler.results()
        tree = measured.tree
        annotate_replicated_params(module, tree)
        events = [(name, _plain(kwargs), start, end) for name, kwargs, start, end in self.hooks.instructions.events]
        parts = [int(part) for part in getattr(module, "parts", None) or []] or None
        gc = dict(measured.gc.as_dict(),
                  in_compute_s=self.hooks.instructions.paused_in(FORWARD_INSTRUCTIONS + BACKWARD_INSTRUCTIONS))
        return RankEntry(
            global_rank=dist.get_rank(), stage_id=layout.stage, tp_rank=layout.tp_rank, dp_rank=layout.dp_rank,
            modules=tree, instructions=self.hooks.instructions.as_dict(), train_batch_latency_s=self.train_batch_s(),
            peak_memory_bytes=peak, events=events, uncounted_ops=[asdict(op) for op in measured.uncounted_ops],
            counted_iteration=counted, calls_differ=list(self.calls_differ), schedule=self.hooks.schedule,
            invisible_attention=measured.invisible_attention, layers=stage_layers(module, layout.stage), parts=parts,
            memory=memory.as_dict() if memory is not None else None, gc=gc,
            faults=[fault.as_dict() for fault in faults], **where_it_ran())

    def entry_or_error(self) -> Union[RankEntry, Exception]:
        """entry(), or the error building it raised: a collective report still needs this rank's part."""
        try:
            return self.entry()
        except Exception as error:
            return error

    def events(self) -> List[ModuleEvent]:
        return self.module_profiler.events() if self.module_profiler is not None else []

    def train_batch_s(self) -> float:
        """The measured iteration's time: train_batch's, or the whole window's on a plain engine."""
        if self.layout.is_pipeline:
            return self._train_batch_s
        start, end = self._window
        return (end if end is not None else self._clock()) - start if start is not None else 0.0

    def local_totals(self) -> Tuple[int, int, float]:
        """(forward FLOPs, params, forward seconds) of this rank's stage so far (zeros before any start)."""
        if self.module_profiler is None:
            return 0, 0, 0.0
        tree = self.module_profiler.tree()
        return tree["fwd_flops"], tree["params"], tree["fwd_latency_s"]


def _plain(kwargs: dict) -> dict:
    return {key: value for key, value in kwargs.items() if isinstance(value, (int, float, str, bool))}
