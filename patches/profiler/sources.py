"""Where a profiler's report comes from, and who prints and writes it: one type per way, never a mode.

- GatheredReports (here): collective. Every rank calls it; the replica's entries travel to global rank 0 over the
  process groups (gather.py), rank 0 builds the report and broadcasts it; rank 0 prints and writes, and a
  write rank 0 fails reaches every rank as ReportWriteError. --profile-flops-step, the config section and
  PipelineFlopsProfiler report this way.
- The sources without a collective (local_sources.py): PublishedReports (DeepSpeed's FlopsProfiler(model[0]) on a
  pipeline, driven by user code on any subset of ranks, through the process group's store), LocalReport (a plain
  DeepSpeedEngine under user code: the calling rank's own measurements), HeldReport (a report built elsewhere,
  held for engine.flops_profiler's getters).

Every source's report(step) returns build_report's dict, built once per step and never edited; print_report is
the one way any of them reaches its reader.
"""
import sys
from typing import Callable, Iterable, List, Optional, Protocol

import torch.distributed as dist

from patches.profiler.context import UNDESCRIBED, IterationTiming, ReportContext, RunDescription
from patches.profiler.files import write_text
from patches.profiler.gather import (
    GatherResult,
    ReportGroups,
    gather_replica,
    gather_report,
    not_built_line,
    rebuild_report,
)
from patches.profiler.layout import EngineLayout
from patches.profiler.measurement import FinishedMeasurement, StageMeasurement
from patches.profiler.printed_modules import format_aggregated
from patches.profiler.printer import format_report
from patches.profiler.trace import build_trace


class ReportWriteError(OSError):
    """Global rank 0 could not write a report file; raised on every rank with rank 0's reason."""


class ProfileIncomplete(RuntimeError):
    """The whole-pipeline report cannot be built: the message names what is missing (one line)."""


class ReportSource(Protocol):
    """What a profiler asks of its source (ProfilerAPI)."""
    emits_here: bool  # whether this rank prints and writes

    def forget(self) -> None: ...  # drop the reports built so far
    def ready(self) -> Optional[dict]: ...  # the report, where it is at hand without a collective; else None
    def report(self, step: Optional[int] = None) -> dict: ...
    def trace(self, step: Optional[int] = None) -> Optional[dict]: ...  # the Chrome trace, where this rank writes
    def emit(self, text: str, output_file: Optional[str] = None) -> None: ...
    def write(self, write: Callable[[], None], path: str) -> None: ...


class MeasuringSource(ReportSource, Protocol):
    """A source that measures its own iteration (all but HeldReport)."""

    def start(self, ignore_list: Optional[Iterable[type]] = None) -> None: ...  # measure afresh


class GatheredReports:
    """Collective: see the module docstring."""

    def __init__(self, measurement: StageMeasurement, run: Optional[RunDescription] = None,
                 timing: Optional[IterationTiming] = None, counting_note: Optional[str] = None):
        """run: what the caller knows of the run (None: what the engine's training loop says, describe_run, at
        report time). counting_note: why the FLOPs were counted in the profiled iteration itself, where the run
        asked otherwise (ProfileSchedule)."""
        self.measurement = measurement
        self.run = run
        # The iteration's timing the report is built over. Set another (ProfileSchedule: once the unprofiled
        # iterations after the profiled one are timed) and the next report() builds it again over that.
        self.timing = timing
        self.counting_note = counting_note
        self._report: Optional[dict] = None
        self._built_over: Optional[IterationTiming] = None  # the timing self._report was built over
        self._entries: Optional[List[dict]] = None  # on global rank 0: replica 0's entries, for the trace
        self._finished: Optional[FinishedMeasurement] = None  # the measurement's end, taken already (gathered())
        self._gathered: Optional[GatherResult] = None  # what the last report() gathered (to build it again)
        self.step: Optional[int] = None  # the step the report is labelled with, once gathered
        self.flops_counting: Optional[dict] = None  # the report's flops_counting, once gathered

    @classmethod
    def gathered(cls, measurement: StageMeasurement, finished: FinishedMeasurement, step: int,
                 timing: Optional[IterationTiming] = None, counting_note: Optional[str] = None) -> "GatheredReports":
        """Collective: the report of a measurement that has finished (StageMeasurement.finish: `finished`, its
        entry and module events), labelled `step`, gathered and built already (ready())."""
        reports = cls(measurement, timing=timing, counting_note=counting_note)
        reports._finished = finished
        reports.report(step)
        return reports

    @property
    def emits_here(self) -> bool:
        return dist.get_rank() == 0

    def start(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        self.forget()
        self.measurement.start(ignore_list)

    def forget(self) -> None:
        self._report, self._entries, self._finished = None, None, None

    def ready(self) -> Optional[dict]:
        """The report built already (over the current timing), or None: never gathers (a getter may be called on
        one rank alone)."""
        return self._report if self._built_over is self.timing else None

    def report(self, step: Optional[int] = None) -> dict:
        """Collective over the world group: every rank calls it (a rank that never measured names itself in the
        error every rank raises). step: the report's label (default: the engine's global steps, DeepSpeed's label)."""
        if step is None:
            step = self._report["step"] if self._report is not None else self.measurement.engine.global_steps
        if self._report is None or self._report["step"] != step:
            measurement = self.measurement
            finished = self._finished
            entry, context = finished.entry if finished is not None else measurement.entry_or_error(), None
            try:  # only rank 0's is used; an error here is this rank's failure, named to every rank
                run = self.run if self.run is not None else describe_run(measurement)
                context = ReportContext.of(measurement.engine, self._layout(), step, run, self.timing,
                                           measurement.skipped_steps_before, counting_note=self.counting_note)
            except Exception as error:
                entry = error
            self._gathered = gather_report(self._layout(), self._groups(), entry, context)
            self._report, self._entries = self._gathered.report, self._gathered.replica_entries
            self.step = step  # the step the report is labelled with
            self.flops_counting = self._report["flops_counting"]  # broadcast: the same on every rank
        elif self._built_over is not self.timing:  # the entries gathered already, built again over the new timing
            self._report = rebuild_report(self._gathered, self.timing, self._groups())
        self._built_over = self.timing
        return self._report

    def _layout(self) -> EngineLayout:
        """Where this rank sits: its measurement's, or read now where it never started one (it still takes part in
        every collective of the report, and names itself in its error)."""
        return self.measurement.layout or EngineLayout.of(self.measurement.engine)

    def _groups(self) -> ReportGroups:
        """The engine's report groups, made on its first report (collective: every rank is in report())."""
        attachment = self.measurement.attachment
        if attachment.report_groups is None:
            attachment.report_groups = ReportGroups.for_layout(self._layout())
        return attachment.report_groups

    def trace(self, step: Optional[int] = None) -> Optional[dict]:
        """Collective over replica 0 (the others return at once): the Chrome trace on global rank 0, else None."""
        report = self.report(step)
        layout = self._layout()
        if not layout.in_replica:  # the trace shows replica 0 only; its ranks alone gather
            return None
        events = self._finished.module_events if self._finished is not None else self.measurement.events()
        gathered = gather_replica((dist.get_rank(), events), layout, self._groups())
        if gathered is None:
            return None
        return build_trace(self._entries, dict(gathered), report["step"])

    def emit(self, text: str, output_file: Optional[str] = None) -> None:
        """Collective: rank 0 prints `text` (or writes it to output_file)."""
        if output_file:
            self.write(lambda: write_text(text, output_file), output_file)
        elif text:
            print(text, flush=True)

    def write(self, write: Callable[[], None], path: str) -> None:
        """Collective: rank 0 runs write(); its OSError reaches every rank at once (a broadcast), so no rank
        trains on into a collective that rank 0, gone, never enters."""
        outcome = [None]
        if dist.get_rank() == 0:
            try:
                write()
            except OSError as error:
                outcome[0] = f"{type(error).__name__}: {error}"
        dist.broadcast_object_list(outcome, src=0, group=self._groups().world)
        if outcome[0] is not None:
            raise ReportWriteError(f"the profile report was not written to {path} on rank 0: {outcome[0]}")



def print_report(source: ReportSource, step: Optional[int] = None, output_file: Optional[str] = None,
                 module_depth: int = -1, top_modules: int = 1, detailed: bool = True,
                 aggregated_only: bool = False) -> dict:
    """The one way a report reaches its reader: source.report(step) (collective where the source is), formatted
    (printer.format_report's module_depth, top_modules, detailed; aggregated_only: its Aggregated Profile alone,
    DeepSpeed's print_model_aggregated_profile) on the rank that emits it alone, and printed there or written to
    output_file. Returns the report."""
    report = source.report(step)
    text = ""
    if source.emits_here:
        text = ("\n".join(format_aggregated(report, module_depth, top_modules)) if aggregated_only
                else format_report(report, module_depth, top_modules, detailed))
    source.emit(text, output_file)
    return report


def describe_run(measurement: StageMeasurement) -> RunDescription:
    """What the training loop that trains the measured engine says of the iteration it runs (its door's
    description, on the engine's attachment), else UNDESCRIBED: for the reports that loop does not ask for itself
    (the config section's, the user's own FlopsProfiler code's, PipelineFlopsProfiler's without a run)."""
    run = measurement.attachment.run
    return run if run is not None else UNDESCRIBED


def warn_on_rank_0(line: str) -> None:
    """One warning line from global rank 0 (training goes on)."""
    if dist.get_rank() == 0:
        print(f"warning: {line}", file=sys.stderr, flush=True)


def warned_not_built(error: BaseException, what: str) -> bool:
    """Whether `error` is a report that could not be built (gather.not_built_line), said then in one warning line
    from global rank 0 (`what`: what is missing): the profiler's failure, which never ends a run. Every rank of
    the report has such an error, so every rank goes on alike."""
    line = not_built_line(error)
    if line is None:
        return False
    warn_on_rank_0(f"FLOPs profiler: {what}: {line}; training goes on")
    return True


def say_on_rank_0(line: str) -> None:
    """One line of the run's log from global rank 0."""
    if dist.get_rank() == 0:
        print(line, flush=True)
