"""One profiled iteration, one way through: the schedule every door runs its iterations through.

    schedule = ProfileSchedule(profile_step=N, counting=...)
    result, profiled = schedule.run(engine, attachment, iteration, run_step)   # or: begin(...) ... end()
    if profiled is not None:   # the profiled iteration: a GatheredReports (collective), for the door to deliver
        ...

The rule, written here once: iteration N-1 counts the FLOPs (a dispatch mode, local to each rank, its
time kept out of the baseline); iteration N is profiled on every rank without that mode (it takes N-1's
counts and checks its own module calls against them), then reported; every other iteration is only
timed, for the unprofiled baseline. N counts in itself where counting is "profiled", where the run is known
to change its shapes between iterations (curriculum learning), or where N-1 did not run here (N is the
first iteration, or the run resumed at N). Where N turns out to have run other module calls or shapes than
N-1, N's figures would be N-1's: it is not reported, and N+1 is profiled instead, counting in itself.

The doors: the Megatron training loops (patches/to_megatron/megatron_door.py: our fork's train() and upstream's patched
train_step) run each iteration through run(); the DeepSpeed config's flops_profiler section
(patches/to_deepspeed/flops_profiler_config.py) runs a PipelineEngine's train_batch through run(), and a plain engine's
step from its first forward (begin) to the step() that ends it (end). Each door delivers what end() returns;
the schedule calls nothing of theirs but the iteration itself.

The baseline: the unprofiled iterations after N where any ran (a door may hold N's report until `settle` of them
have run, or the run's last iteration, or its flush(): the Megatron door waits for STEADY_AFTER), else those
before N past the warm-up; the run's first iteration alone, or none, is said in the report (Baseline.note).

Iterations are numbered by the door, by one convention (numbering.py).
"""
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, TypeVar

from deepspeed.runtime.engine import DeepSpeedEngine

from patches.profiler.attachment import EngineAttachment
from patches.profiler.context import IterationTiming
from patches.profiler.iteration_clock import IterationClock
from patches.profiler.measurement import CountingPass, StageMeasurement
from patches.profiler.sources import GatheredReports, say_on_rank_0, warn_on_rank_0, warned_not_built

Result = TypeVar("Result")

# Where the FLOPs of the profiled iteration are counted (--profile-flops-counting).
COUNT_IN_PREVIOUS, COUNT_IN_PROFILED = "previous", "profiled"
COUNTING_CHOICES = (COUNT_IN_PREVIOUS, COUNT_IN_PROFILED)

# What an iteration is to the schedule.
COUNT, PROFILE, TIME = "count", "profile", "time"

# Unprofiled iterations after the profiled one that a door's report waits for (ProfileSchedule's `settle`): a
# run profiled early (DeepSpeed's profile_step defaults to 1) has only warm-up iterations before it.
STEADY_AFTER = 3


def counting_announcement(profile_step: int, counting: str, first_done: Optional[int],
                          shapes_change: Optional[str] = None) -> str:
    """The start-up line's tail: where ProfileSchedule will count the FLOPs of profile_step, said before the run.
    first_done: iterations done before this run (a resumed run cannot count in an iteration it does not run);
    None where not known yet. Iterations are numbered from 1 (Megatron's): iteration 1 has none before it.
    shapes_change: as ProfileSchedule's."""
    if shapes_change:
        return f", its FLOPs counted in it (the run changes its shapes between iterations: {shapes_change})"
    resumed_after_it = first_done is not None and profile_step - 1 <= first_done
    if counting != COUNT_IN_PREVIOUS or profile_step == 1 or resumed_after_it:
        return ", its FLOPs counted in it"
    if first_done is None:
        return (f", its FLOPs counted in iteration {profile_step - 1} (in it if this run starts at iteration "
                f"{profile_step})")
    return f", its FLOPs counted in iteration {profile_step - 1}"


@dataclass
class _OpenIteration:
    """The iteration between begin() and end()."""
    engine: DeepSpeedEngine
    iteration: int
    role: str
    start_s: float  # time.time(), the clock of the unprofiled iterations
    measurement: Optional[StageMeasurement]  # counting or profiling; None for a timed iteration
    counted: Optional[CountingPass] = None  # the profiled iteration's counting pass (None: it counts itself)


@dataclass(frozen=True)
class _Waiting:
    """The profiled iteration, gathered, until the unprofiled iterations after it are timed."""
    iteration: int
    reports: GatheredReports


class ProfileSchedule:
    """Which iteration counts, which is profiled and reported, which is only timed (see the module docstring)."""

    def __init__(self, profile_step: Optional[int], counting: str = COUNT_IN_PREVIOUS,
                 shapes_change: Optional[str] = None, last_iteration: Optional[int] = None, settle: int = 0,
                 first_done: Optional[int] = None):
        """profile_step: the iteration to profile (None: none; every iteration is only timed), in the door's
        numbering. shapes_change: None, or why the run's iterations differ in shape (curriculum learning, ...),
        known before it starts: then the profiled iteration counts in itself, whatever `counting` asks.
        last_iteration: the run's last iteration, where known. settle: unprofiled iterations after the profiled
        one its report waits for (its baseline; 0: none, the report comes at the profiled iteration's end); it
        comes sooner at last_iteration, or when the door asks (flush()). first_done: the iterations done before
        this run, where the door knows it (None: not known), for `announcement`, the start-up line's tail
        (counting_announcement; None where nothing is profiled)."""
        if counting not in COUNTING_CHOICES:
            raise ValueError(f"counting must be one of {COUNTING_CHOICES}, not {counting!r}")
        self.profile_step = profile_step
        self.counting = COUNT_IN_PROFILED if shapes_change else counting
        # why the profiled iteration counts in itself although 'previous' was asked (the report says it)
        self.counting_note = f"the run changes its shapes between iterations: {shapes_change}" \
            if shapes_change and counting == COUNT_IN_PREVIOUS else None
        self.last_iteration = last_iteration
        self.shapes_change = shapes_change
        self.settle = settle
        self.clock = IterationClock()
        self._counted: Optional[CountingPass] = None  # the counting pass, until the iteration after it
        self._open: Optional[_OpenIteration] = None
        self._waiting: Optional[_Waiting] = None  # the profiled iteration's report, until its baseline is timed
        self.announcement = counting_announcement(profile_step, self.counting, first_done, shapes_change) \
            if profile_step is not None else None

    def role(self, iteration: int) -> str:
        if self.profile_step is None:
            return TIME
        if iteration == self.profile_step:
            return PROFILE
        if self.counting == COUNT_IN_PREVIOUS and iteration == self.profile_step - 1:
            return COUNT
        return TIME

    @property
    def running(self) -> Optional[int]:
        """The iteration between begin() and end() (or abandon()); None outside one."""
        return self._open.iteration if self._open is not None else None

    def run(self, engine: DeepSpeedEngine, attachment: EngineAttachment, iteration: int,
            run_step: Callable[[], Result]) -> Tuple[Result, Optional[GatheredReports]]:
        """(run_step's result, the profiled iteration's reports or None): begin, run_step, end. Collective on the
        profiled iteration: every rank runs the same iterations through its schedule. attachment: the engine's
        (attachment.py), which the door holds."""
        self.begin(engine, attachment, iteration)
        try:
            result = run_step()
        except BaseException:
            self.abandon()
            raise
        return result, self.end()

    def begin(self, engine: DeepSpeedEngine, attachment: EngineAttachment, iteration: int) -> None:
        """The iteration starts: its clock, and its counting or profiling measurement attached to the engine."""
        role = self.role(iteration)
        if self._counted is not None and iteration != self._counted.iteration + 1:
            self._counted = None  # the iteration after the counting pass did not come through here
        measurement, counted = None, None
        if role != TIME:
            if role == PROFILE:
                counted, self._counted = self._counted, None  # None where iteration N-1 did not run here
            measurement = StageMeasurement.begin(engine, attachment, counted)
        self._open = _OpenIteration(engine, iteration, role, time.time(), measurement, counted)

    def abandon(self) -> None:
        """The iteration raised: its time is kept (perturbed where measured), every hook comes off, no report."""
        opened, self._open = self._open, None
        if opened is None:
            return
        self.clock.record(opened.iteration, time.time() - opened.start_s)
        if opened.measurement is not None:
            self.clock.mark_perturbed(opened.iteration)
            opened.measurement.detach()

    def end(self) -> Optional[GatheredReports]:
        """The iteration has run: its time recorded; the counting pass kept for the next one; the profiled
        iteration's report gathered (collective) and returned, with every hook off the engine. None otherwise."""
        opened, self._open = self._open, None
        seconds = time.time() - opened.start_s
        self.clock.record(opened.iteration, seconds)
        measurement = opened.measurement
        if measurement is None:
            return self._when_settled(opened.iteration)
        self.clock.mark_perturbed(opened.iteration)
        if opened.role == COUNT:
            measurement.detach()
            self._counted = CountingPass(opened.iteration, measurement.module_profiler, measurement.measured_memory,
                                         tuple(measurement.faults.faults))
            return None
        finished = measurement.finish()  # every hook off the engine; what it measured stays readable
        counting_s = self.clock.seconds.get(opened.counted.iteration) if opened.counted is not None else None
        try:
            reports = GatheredReports.gathered(measurement, finished, opened.iteration,
                                               self._timing(opened.iteration, seconds, counting_s), self.counting_note)
        except Exception as error:
            if not warned_not_built(error, f"no report of iteration {opened.iteration}"):
                raise
            return None
        counting = reports.flops_counting  # broadcast: every rank decides alike
        if counting["calls_differ"]:
            self._count_again(opened.iteration, counting["counted_iteration"], counting["calls_differ"])
            return None
        self._waiting = _Waiting(opened.iteration, reports)
        return self._when_settled(opened.iteration)

    def _timing(self, iteration: int, profiled_s: float, counting_s: Optional[float]) -> IterationTiming:
        """The profiled iteration's time against its baseline as the clock has it now."""
        baseline = self.clock.baseline(iteration)
        return IterationTiming(profiled_s, baseline.median_s, baseline.iterations, counting_s,
                               unprofiled_spread=baseline.spread, baseline_note=baseline.note)

    def _when_settled(self, iteration: int) -> Optional[GatheredReports]:
        """The waiting report, once `settle` unprofiled iterations after it have run, or at the run's last."""
        if self._waiting is None:
            return None
        settled = len(self.clock.unprofiled_after(self._waiting.iteration)) >= self.settle
        if settled or (self.last_iteration is not None and iteration >= self.last_iteration):
            return self.flush()
        return None

    def flush(self) -> Optional[GatheredReports]:
        """The profiled iteration's reports now, timed over the unprofiled iterations timed so far (the door's
        report() builds them again over that timing, collectively: every rank of the run flushes at the same
        point, the door at its loop's end); None where none is waiting."""
        waiting, self._waiting = self._waiting, None
        if waiting is None:
            return None
        if self.clock.unprofiled_after(waiting.iteration):  # built at the profiled iteration without them
            timed = waiting.reports.timing  # the report is built again over this at the door's report()
            waiting.reports.timing = self._timing(waiting.iteration, timed.profiled_iter_s, timed.counting_iter_s)
        return waiting.reports

    def _count_again(self, iteration: int, counted: int, differ: List[str]) -> None:
        """The profiled iteration ran other module calls or input shapes than the counting one: its FLOPs are not
        the counted ones, so no report of it. The next iteration is profiled instead, counting in itself."""
        what = (f"iteration {iteration} ran other module calls or input shapes than iteration {counted}, where its "
                f"FLOPs were counted ({len(differ)} places, e.g. {differ[0]})")
        if self.last_iteration is not None and iteration >= self.last_iteration:
            warn_on_rank_0(f"FLOPs profiler: no report: {what}, and it was the last iteration; profile an earlier "
                           "one, or count in the profiled iteration itself (--profile-flops-counting profiled)")
            return
        self.profile_step, self.counting = iteration + 1, COUNT_IN_PROFILED
        self.counting_note = f"{what}: iteration {iteration + 1} was profiled instead"
        say_on_rank_0(f"> FLOPs profiler (patches): {what}: profiling iteration {iteration + 1} instead, its FLOPs "
                      "counted in it (no report if the run ends before it)")
