"""One profiled iteration, one way through: the scheduler every training loop calls once per iteration.

    schedule = ProfileSchedule(profile_step=N, describe=..., output=FileOutput(directory))
    while training:
        result = schedule.run(engine, iteration, lambda: train_step(...))

The rule, written here once: iteration N-1 counts the FLOPs (a dispatch mode, local to each rank, its
time kept out of the baseline); iteration N is profiled on every rank without that mode (it takes N-1's
counts and checks its own module calls against them), then reported; every other iteration is only
timed, for the unprofiled baseline. N counts in itself where counting is "profiled", where the run is known
to change its shapes between iterations (curriculum learning), or where N-1 did not run here (N is the
first iteration, or the run resumed at N). Where N turns out to have run other module calls or shapes than
N-1, N's figures would be N-1's: it is not reported, and N+1 is profiled instead, counting in itself.

Our fork's train(), upstream's patched train_step (megatron_upstream.py) and DeepSpeed's config section on a
PipelineEngine (flops_profiler_config.py) each own one schedule and keep no scheduling state of their own;
the section on a plain DeepSpeedEngine, whose step is not one call, reports through report_and_detach.
"""
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Set, Tuple, TypeVar

from deepspeed.runtime.engine import DeepSpeedEngine

from patches.profiler.context import IterationTiming, RunDescription
from patches.profiler.files import write_json, write_tensorboard_scalars, write_trace
from patches.profiler.measurement import CountingPass, StageMeasurement, count_flops
from patches.profiler.printer import format_report
from patches.profiler.sources import GatheredReports, ReportWriteError, say_on_rank_0, warn_on_rank_0

Result = TypeVar("Result")

# Where the FLOPs of the profiled iteration are counted (--profile-flops-counting).
COUNT_IN_PREVIOUS, COUNT_IN_PROFILED = "previous", "profiled"
COUNTING_CHOICES = (COUNT_IN_PREVIOUS, COUNT_IN_PROFILED)

# What an iteration is to the schedule.
COUNT, PROFILE, TIME = "count", "profile", "time"

# Unprofiled iterations the baseline median is taken over: the last ones before the profiled iteration.
WINDOW = 5


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


class ReportOutput(Protocol):
    """What a schedule does with its profiled iteration's report (FileOutput; the config section's)."""

    def deliver(self, reports: GatheredReports, step: int) -> None: ...  # collective: every rank calls it


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


@dataclass(frozen=True)
class FileOutput:
    """What --profile-flops-step does with its report: global rank 0 prints it and writes
    flops_profile_stepN.json and pipeline_trace_stepN.json into `directory`; a TensorBoard writer (where the
    rank has one) gets the headline scalars. A file rank 0 cannot write is one warning line; training goes on."""
    directory: str
    tensorboard_writer: Any = None

    def json_path(self, step: int) -> str:
        return os.path.join(self.directory, f"flops_profile_step{step}.json")

    def trace_path(self, step: int) -> str:
        return os.path.join(self.directory, f"pipeline_trace_step{step}.json")

    def deliver(self, reports: GatheredReports, step: int) -> None:
        """Collective: every rank calls it for the same report."""
        report = reports.report(step)
        reports.emit(format_report(report) if reports.emits_here else "")
        json_path, trace_path = self.json_path(step), self.trace_path(step)
        try:
            # files.write_json makes the directory on rank 0: its failure, too, reaches every rank
            reports.write(lambda: write_json(report, json_path), json_path)
            trace = reports.trace(step)
            reports.write(lambda: write_trace(trace, trace_path), trace_path)
        except ReportWriteError as error:  # every rank has it: training goes on, unprofiled, on every rank
            warn_on_rank_0(f"{error}; training goes on")
        if self.tensorboard_writer is not None:
            write_tensorboard_scalars(report, self.tensorboard_writer, step)


class ProfileSchedule:
    """Which iteration counts, which is profiled and reported, which is only timed (see the module docstring)."""

    def __init__(self, profile_step: Optional[int], describe: Callable[[DeepSpeedEngine], RunDescription],
                 output: ReportOutput, counting: str = COUNT_IN_PREVIOUS, shapes_change: Optional[str] = None,
                 last_iteration: Optional[int] = None):
        """profile_step: the iteration to profile (None: none; every iteration is only timed), in the caller's
        numbering. describe(engine): what the caller knows of its run, asked once, after the profiled
        iteration. output: what to do with the report (FileOutput, or the config section's), its
        deliver(reports, step) called on every rank. shapes_change: None, or why the run's iterations differ in
        shape (curriculum learning, ...), known before it starts: then the profiled iteration counts in itself,
        whatever `counting` asks. last_iteration: the run's last iteration, where known."""
        if counting not in COUNTING_CHOICES:
            raise ValueError(f"counting must be one of {COUNTING_CHOICES}, not {counting!r}")
        self.profile_step = profile_step
        self.counting = COUNT_IN_PROFILED if shapes_change else counting
        # why the profiled iteration counts in itself although 'previous' was asked (the report says it)
        self.counting_note = f"the run changes its shapes between iterations: {shapes_change}" \
            if shapes_change and counting == COUNT_IN_PREVIOUS else None
        self.describe = describe
        self.output = output
        self.last_iteration = last_iteration
        self.clock = IterationClock()
        self._counted: Optional[CountingPass] = None  # the counting pass, until the iteration after it

    def role(self, iteration: int) -> str:
        if self.profile_step is None:
            return TIME
        if iteration == self.profile_step:
            return PROFILE
        if self.counting == COUNT_IN_PREVIOUS and iteration == self.profile_step - 1:
            return COUNT
        return TIME

    def run(self, engine: DeepSpeedEngine, iteration: int, run_step: Callable[[], Result]) -> Result:
        """Run one iteration (run_step) as the schedule has it. Collective on the profiled iteration: every rank
        calls run for the same iterations."""
        role = self.role(iteration)
        if self._counted is not None and iteration != self._counted.iteration + 1:
            self._counted = None  # the iteration after the counting pass did not come through here
        if role == COUNT:
            try:
                result, self._counted = self.clock.timed(iteration, lambda: count_flops(engine, iteration, run_step))
            finally:
                self.clock.mark_perturbed(iteration)
            return result
        if role == PROFILE:
            counted, self._counted = self._counted, None  # None where iteration N-1 did not run here
            return self._profile(engine, iteration, run_step, counted)
        return self.clock.timed(iteration, run_step)

    def _profile(self, engine, iteration, run_step, counted):
        """Profile one iteration on every rank, then report it through self.output (collective)."""
        measurement = StageMeasurement(engine)
        measurement.start(counted=counted)
        try:
            start = time.time()  # the clock of the unprofiled iterations (IterationClock)
            try:
                result = run_step()
            finally:
                profiled_s = time.time() - start
                self.clock.mark_perturbed(iteration)
                measurement.stop()
            unprofiled_s, unprofiled = self.clock.unprofiled_before(iteration)
            counting_s = self.clock.seconds.get(counted.iteration) if counted is not None else None
            timing = IterationTiming(profiled_s, unprofiled_s, unprofiled, counting_s)
            reports = GatheredReports(measurement, self.describe(engine), timing, self.counting_note)
            counting = reports.report(iteration)["flops_counting"]  # broadcast: every rank decides alike
            if counting["calls_differ"]:
                self._count_again(iteration, counting["counted_iteration"], counting["calls_differ"])
            else:
                self.output.deliver(reports, iteration)
        finally:
            measurement.detach()
        return result

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


def report_and_detach(measurement: StageMeasurement, step: int, output: ReportOutput,
                      run: Optional[RunDescription] = None) -> None:
    """Collective: the stopped measurement's report, gathered (sources.GatheredReports) and handed to output on
    every rank; then, whatever happened, every hook comes off the engine. (The config section on a plain
    DeepSpeedEngine: its step is not one call a schedule can run.)"""
    try:
        output.deliver(GatheredReports(measurement, run), step)
    finally:
        measurement.detach()
