"""Python's garbage collections while the profiler measures: the pauses they make, taken out of its clocks.

A collection stops the training thread wherever an allocation set it off, for as long as it takes: a
generation-2 collection of a training process with torch and DeepSpeed loaded takes 100 to 300 ms on CPU, about
one in eight iterations. Landing inside one layer's call, it made that layer look several times heavier
than its twins, and a partition planned from it moved layers for it. A pause is no module's work, so
the module clocks (phase_stack.py) and each instruction's compute (InstructionTimer) leave it out, and the
report gives the pauses by themselves, per stage.

The clock without pauses is perf_counter() minus the pauses so far (`paused_s`), read together: a
collection runs only where Python allocates a tracked object, never between two float reads.
"""
import gc
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

_perf_counter = time.perf_counter


@dataclass
class GcSummary:
    """The collections of one measured stretch (a profiled iteration), as the report gives them."""
    collections: int = 0
    pause_s: float = 0.0  # all of them together
    longest_s: float = 0.0
    generation_2: int = 0  # the full collections among them, the long ones

    def as_dict(self) -> dict:
        return asdict(self)


class GcPauses:
    """Every garbage collection while watching: `paused_s` (seconds, monotone) and a summary since clear().

    before_pause(): called as a collection starts (the device's synchronize: the work queued before the pause
    counts, as at every clock read)."""

    def __init__(self, before_pause: Optional[Callable[[], None]] = None):
        self._before_pause = before_pause
        self.paused_s = 0.0
        self.summary = GcSummary()
        self._started: Optional[float] = None
        self._watching = False

    def watch(self) -> None:
        if not self._watching:
            gc.callbacks.append(self._on_collection)
            self._watching = True

    def unwatch(self) -> None:
        if self._watching:
            gc.callbacks.remove(self._on_collection)
            self._watching = False
            self._started = None

    def clear(self) -> None:
        """A new summary from now on (paused_s keeps counting: clocks read before and after stay comparable)."""
        self.summary = GcSummary()

    def clock(self) -> float:
        """perf_counter without the pauses while watching."""
        return _perf_counter() - self.paused_s

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            if self._before_pause is not None:
                self._before_pause()
            self._started = _perf_counter()
            return
        if self._started is None:  # watching began during this collection
            return
        pause = _perf_counter() - self._started
        self._started = None
        self.paused_s += pause
        summary = self.summary
        summary.collections += 1
        summary.pause_s += pause
        summary.longest_s = max(summary.longest_s, pause)
        summary.generation_2 += info.get("generation") == 2
