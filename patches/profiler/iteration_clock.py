"""The wall time of each iteration a schedule ran (one_step.ProfileSchedule's clock), and the unprofiled iterations
a profiled one is compared with (its baseline): after it where any ran, else before it past the warm-up."""
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple, TypeVar

Result = TypeVar("Result")

# Unprofiled iterations the baseline median is taken over: the last ones before the profiled iteration.
WINDOW = 5


@dataclass(frozen=True)
class Baseline:
    """The unprofiled iterations a profiled one is compared with (IterationClock.baseline)."""
    median_s: Optional[float]  # None: no unprofiled iteration was timed
    iterations: List[int]
    spread: Optional[float]  # (slowest - fastest) / median; None under two iterations
    note: Optional[str]  # why it is weaker than steady iterations, or None


class IterationClock:
    """Wall seconds of each iteration this process ran, by iteration number (time.time(), as the training log
    line's time is read)."""

    def __init__(self):
        self.seconds: Dict[int, float] = {}
        self.first: Optional[int] = None  # the process's first iteration: its time includes warm-up
        self.perturbed: Set[int] = set()  # iterations slowed by the profiler (its counting pass): never a baseline

    def timed(self, iteration: int, step: Callable[[], Result]) -> Result:
        start = time.time()
        try:
            return step()
        finally:
            self.record(iteration, time.time() - start)

    def record(self, iteration: int, seconds: float) -> None:
        self.seconds[iteration] = seconds
        if self.first is None:
            self.first = iteration
        self.seconds.pop(iteration - 2 * WINDOW, None)  # only the recent ones are ever read

    def mark_perturbed(self, iteration: int) -> None:
        self.perturbed.add(iteration)

    def unprofiled_before(self, step: int) -> Tuple[Optional[float], List[int]]:
        """(median seconds, the iterations it is taken over): up to WINDOW iterations before `step`, leaving
        out the perturbed ones and the process's first (warm-up) unless it is the only one; (None, []) when
        there is none."""
        ran = sorted(i for i in self.seconds if i < step and i not in self.perturbed)
        if len(ran) > 1 and ran[0] == self.first:
            ran = ran[1:]
        ran = ran[-WINDOW:]
        if not ran:
            return None, []
        return statistics.median(self.seconds[i] for i in ran), ran

    def unprofiled_after(self, step: int) -> List[int]:
        """The unprofiled iterations timed after `step`, in order."""
        return sorted(i for i in self.seconds if i > step and i not in self.perturbed)

    def baseline(self, step: int) -> Baseline:
        """What the profiled iteration `step` is compared with: the unprofiled iterations after it where any ran
        (up to WINDOW: past the warm-up and the counting pass), else unprofiled_before(step), said where that is
        the process's first iteration alone (warm-up) or nothing."""
        ran = self.unprofiled_after(step)[:WINDOW]
        note = None
        if not ran:
            ran = self.unprofiled_before(step)[1]
            if ran == [self.first]:
                note = (f"the only unprofiled iteration timed is iteration {self.first}, the run's first: it "
                        "includes warm-up, so the rates and the plan rest on it (time a few iterations after the "
                        "profiled one for a steady baseline)")
            elif not ran:
                note = "no unprofiled iteration was timed: the rates are over the profiled iteration"
        if not ran:
            return Baseline(None, [], None, note)
        times = [self.seconds[i] for i in ran]
        median = statistics.median(times)
        spread = (max(times) - min(times)) / median if len(times) > 1 and median > 0 else None
        return Baseline(median, ran, spread, note)
