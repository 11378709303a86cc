"""Everything the profiler attaches to one DeepSpeed engine, and its exact removal.

- the schedule instructions: PipelineEngine._exec_schedule looks each instruction up in
  `self._INSTRUCTION_MAP`; an instance attribute of that name shadows the class's map, so timing
  one engine touches no class and no other engine;
- TiedLayerSpec(forward_fn=...) entries of a PipelineModule, which are plain function calls that no
  module hook sees: each is swapped for a proxy that runs it under the tied module's scope.
Removing restores every attribute and list entry as it was; deleting the instance attribute uncovers the
class's map again. The engine's own methods are never shadowed: their one class-level wrapper
(patches/to_deepspeed/engine_methods.py) hands train_batch to time_train_batch, and a plain engine's forward,
backward and step to the instruction timer (InstructionTimer.run), while this engine's measurement is attached.
"""
import contextlib
import functools
import time
from collections import defaultdict
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Tuple, TypeVar

import deepspeed.runtime.pipe.schedule as ds_schedule
from deepspeed.runtime.engine import DeepSpeedEngine

from patches.profiler.gc_pauses import GcPauses
from patches.profiler.instructions import BACKWARD_OUTSIDE_AUTOGRAD
from patches.profiler.layout import EngineLayout
from patches.profiler.module_profiler import ModuleProfiler
from patches.profiler.shadowing import shadow

Result = TypeVar("Result")

# (instruction name, its keyword arguments, start, end): one schedule instruction as it ran.
InstructionEvent = Tuple[str, Dict[str, Any], float, float]


def synchronized_clock(synchronize: Callable[[], None]) -> float:
    """perf_counter once the device's queued work is done, so a span covers the work, not its launch."""
    synchronize()
    return time.perf_counter()


class InstructionTimer:
    """Device-synchronized totals, counts and events of the instructions it wraps, and the garbage collector's
    pauses inside each (`pauses`: the module profiler's, gc_pauses.py)."""

    def __init__(self, synchronize: Callable[[], None], pauses: Optional[GcPauses] = None):
        self.synchronize = synchronize
        self.pauses = pauses or GcPauses()  # one not watching pauses nothing
        self.totals: Dict[str, float] = defaultdict(float)
        self.paused: Dict[str, float] = defaultdict(float)  # seconds of collections inside, by instruction
        self.counts: Dict[str, int] = defaultdict(int)
        self.events: List[InstructionEvent] = []  # the schedule as it ran
        # around(name, buffer_id): a context each instruction runs in, inside its clock reads (the memory
        # measurement's); None: none
        self.around: Optional[Callable[[str, Optional[int]], ContextManager[None]]] = None

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn(engine, ...) wrapped with a synchronize and a clock read on both sides."""
        def run(engine, *args, **kwargs):
            return self.run(name, functools.partial(fn, engine, *args, **kwargs), kwargs)
        return run

    def run(self, name: str, call: Callable[[], Result], kwargs: Optional[Dict[str, Any]] = None) -> Result:
        """call(), timed as instruction `name` (kwargs: the instruction's, for its event)."""
        around = self.around(name, (kwargs or {}).get("buffer_id")) if self.around else contextlib.nullcontext()
        start = synchronized_clock(self.synchronize)
        paused = self.pauses.paused_s
        try:
            with around:
                return call()
        finally:
            end = synchronized_clock(self.synchronize)
            self.paused[name] += self.pauses.paused_s - paused
            self.totals[name] += end - start
            self.counts[name] += 1
            self.events.append((name, kwargs or {}, start, end))

    def paused_in(self, names: Iterable[str]) -> float:
        """Seconds of garbage collection inside these instructions."""
        return sum(self.paused.get(name, 0.0) for name in names)

    def reset(self) -> None:
        self.totals.clear()
        self.paused.clear()
        self.counts.clear()
        self.events = []

    def as_dict(self) -> Dict[str, Dict[str, float]]:
        return {name: {"count": self.counts[name], "total_s": self.totals[name]} for name in sorted(self.counts)}


class DeepSpeedInternalsMissing(RuntimeError):
    """A private DeepSpeed name the profiler relies on is gone (renamed in a release): refuse, never report zeros."""


def missing_internals(engine: DeepSpeedEngine, layout: EngineLayout) -> List[str]:
    """The private DeepSpeed names this engine lacks of those the hooks use."""
    if not layout.is_pipeline:
        return []
    wanted = [(type(engine), "PipelineEngine._INSTRUCTION_MAP", "_INSTRUCTION_MAP"),
              (engine.module, "PipelineModule.forward_funcs", "forward_funcs"),
              (engine.module, "PipelineModule.tied_modules", "tied_modules")]
    return [label for owner, label, name in wanted if not hasattr(owner, name)]


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


class EngineHooks:
    """The instruction timer and the tied forward proxies of one engine."""

    def __init__(self, engine: DeepSpeedEngine, layout: EngineLayout, module_profiler: ModuleProfiler,
                 synchronize: Callable[[], None]):
        self.engine = engine
        self.layout = layout
        self.module_profiler = module_profiler
        self.synchronize = synchronize
        self.instructions = InstructionTimer(synchronize, module_profiler.gc_pauses)
        self._undo: List[Callable[[], None]] = []
        # the class PipelineEngine.train_batch builds its schedule from (a Megatron may replace DeepSpeed's
        # TrainSchedule, as upstream's zero-bubble option does); None on a plain engine
        self.schedule: Optional[str] = None

    @classmethod
    def attach(cls, engine: DeepSpeedEngine, layout: EngineLayout, module_profiler: ModuleProfiler,
               synchronize: Callable[[], None]) -> "EngineHooks":
        """The hooks of `engine`, installed."""
        hooks = cls(engine, layout, module_profiler, synchronize)
        hooks.install()
        return hooks

    def install(self) -> None:
        engine = self.engine
        missing = missing_internals(engine, self.layout)
        if missing:
            raise DeepSpeedInternalsMissing(
                f"the profiler cannot attach to this DeepSpeed {_deepspeed_version()}: it has no {', '.join(missing)} "
                "(schedule timings and tied-layer credit would be silently empty)")
        if self.layout.is_pipeline:
            self._credit_tied_forward_fns()
            self._shadow("_INSTRUCTION_MAP", {
                instruction: self.instructions.timed(instruction.__name__, self._as_backward(method)
                                                     if instruction.__name__ in BACKWARD_OUTSIDE_AUTOGRAD else method)
                for instruction, method in type(engine)._INSTRUCTION_MAP.items()})
            self.schedule = getattr(ds_schedule.TrainSchedule, "__name__", None)

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def reset(self) -> None:
        """Zero the timings."""
        self.instructions.reset()

    def _as_backward(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """An instruction whose work is backward work run outside autograd (BACKWARD_OUTSIDE_AUTOGRAD)."""
        def run(engine, *args, **kwargs):
            with self.module_profiler.backward_outside_autograd():
                return method(engine, *args, **kwargs)
        return run

    def _credit_tied_forward_fns(self) -> None:
        module = self.engine.module
        tied = set(id(m) for m in module.tied_modules.values())
        funcs = module.forward_funcs
        for index, func in enumerate(funcs):
            if isinstance(func, functools.partial) and func.args and id(func.args[0]) in tied and len(func.args) == 1:
                funcs[index] = self.module_profiler.scoped_call(func.args[0], func.func)
                self._undo.append(functools.partial(funcs.__setitem__, index, func))

    def _shadow(self, name: str, replacement: Any) -> None:
        """Set an attribute on this engine instance only, undone by remove()."""
        self._undo.append(shadow(self.engine, name, replacement))

