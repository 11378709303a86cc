"""What the profiler could not measure, kept out of the run it measures.

Parts of the profiler run inside the user's iteration: around each schedule instruction, inside a layer's call,
inside ZeRO's release of its buckets. An error raised by the profiler's own code there must not become the
iteration's error. A FaultLog catches it, records it as a MeasurementFault, and turns that part of the measurement
off for the rest of the iteration (`failed(part)`); the user's work it wraps runs exactly once, as it would
unmeasured, and raises what it raises. The rank's entry carries the faults; the report lists them, one line each.

    faults = FaultLog()
    with faults.guard(MEMORY, "start"): ...                        # the profiler's own code only
    with faults.around(MEMORY, "ForwardPass", context): ...        # the user's work inside a context of ours
"""
import contextlib
from dataclasses import asdict, dataclass
from typing import ContextManager, Iterator, List

# The parts of a measurement that can fail alone, leaving the rest of the report standing.
MEMORY = "memory"


@dataclass(frozen=True)
class MeasurementFault:
    """One part of a rank's measurement that failed, and why."""
    part: str  # what is missing from the report: MEMORY
    where: str  # when it failed: "start", "stop", or the instruction it ran around
    error: str  # the error's type and first line

    def as_dict(self) -> dict:
        return asdict(self)


def error_line(error: BaseException) -> str:
    """An error's type and the first line of its message."""
    first = str(error).strip().splitlines()
    return f"{type(error).__name__}: {first[0]}" if first else type(error).__name__


class FaultLog:
    """The faults of one measurement (see the module docstring); the first of a part is the one kept."""

    def __init__(self):
        self.faults: List[MeasurementFault] = []

    def failed(self, part: str) -> bool:
        return any(fault.part == part for fault in self.faults)

    def record(self, part: str, where: str, error: BaseException) -> None:
        if not self.failed(part):
            self.faults.append(MeasurementFault(part, where, error_line(error)))

    @contextlib.contextmanager
    def guard(self, part: str, where: str) -> Iterator[None]:
        """The profiler's own code: an Exception it raises is recorded, not raised (never wrap the user's work)."""
        try:
            yield
        except Exception as error:
            self.record(part, where, error)

    @contextlib.contextmanager
    def around(self, part: str, where: str, context: ContextManager[None]) -> Iterator[None]:
        """The user's work inside a context of the profiler's (not entered yet: a generator's context runs
        nothing until entered): entering and leaving it are guarded, the work runs once whatever they do, and its
        own error is raised as it came. After a fault of `part`, the context is not entered."""
        entered = False
        if not self.failed(part):
            with self.guard(part, where):
                context.__enter__()
                entered = True
        if not entered:
            yield
            return
        try:
            yield
        except BaseException as error:
            with self.guard(part, where):
                context.__exit__(type(error), error, error.__traceback__)
            raise
        with self.guard(part, where):
            context.__exit__(None, None, None)
