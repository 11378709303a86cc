"""Where a profiler's report comes from, and who prints and writes it: one type per way, never a mode.

- GatheredReports: collective. Every rank calls it; the replica's entries travel to global rank 0 over the
  process groups (gather.py), rank 0 builds the report and broadcasts it; rank 0 prints and writes, and a
  write rank 0 fails reaches every rank as ReportWriteError. --profile-flops-step, the config section and
  PipelineFlopsProfiler report this way.
- PublishedReports: no collective. Each rank that measured a pipeline's train_batch publishes its entry in the
  process group's store when that train_batch returns (store_exchange.py); any rank that asks builds the
  whole-pipeline report from the store, waiting a bounded time for each rank, and prints or writes it
  itself. DeepSpeed's FlopsProfiler(model[0]), driven by user code on any subset of ranks, reports this way.
- LocalReport: a plain DeepSpeedEngine driven by user code: the calling rank's own measurements, as stock
  DeepSpeed reports them.
- HeldReport: a report built elsewhere (the config section's, gathered), held for the getters and prints of
  engine.flops_profiler afterwards, on any rank, with no collective.

Every source's report(step) returns build_report's dict, built once per step and never edited.
"""
import sys
from typing import Callable, Iterable, List, Optional, Protocol, Union

import torch.distributed as dist

from patches.profiler import store_exchange
from patches.profiler.context import UNDESCRIBED, IterationTiming, ReportContext, RunDescription
from patches.profiler.entry import RankEntry
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
from patches.profiler.measurement import StageMeasurement
from patches.profiler.numbering import running_iteration
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from patches.profiler.stragglers import RankSample
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
        self._entry: Union[RankEntry, Exception, None] = None  # the rank's entry, taken already (gathered())
        self._gathered: Optional[GatherResult] = None  # what the last report() gathered (to build it again)
        self.step: Optional[int] = None  # the step the report is labelled with, once gathered

    @classmethod
    def gathered(cls, measurement: StageMeasurement, entry: Union[RankEntry, Exception], step: int,
                 timing: Optional[IterationTiming] = None, counting_note: Optional[str] = None) -> "GatheredReports":
        """Collective: the report of a measurement that has finished (StageMeasurement.finish: `entry`), labelled
        `step`, gathered and built already (ready())."""
        reports = cls(measurement, timing=timing, counting_note=counting_note)
        reports._entry = entry
        reports.report(step)
        return reports

    @property
    def emits_here(self) -> bool:
        return dist.get_rank() == 0

    def start(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        self.forget()
        self.measurement.start(ignore_list)

    def forget(self) -> None:
        self._report, self._entries, self._entry = None, None, None

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
            entry, context = self._entry if self._entry is not None else measurement.entry_or_error(), None
            try:  # only rank 0's is used; an error here is this rank's failure, named to every rank
                run = self.run if self.run is not None else describe_run(measurement)
                context = ReportContext.of(measurement.engine, measurement.layout, step, run, self.timing,
                                           measurement.skipped_steps_before, counting_note=self.counting_note)
            except Exception as error:
                entry = error
            self._gathered = gather_report(measurement.layout, self._groups(), entry, context)
            self._report, self._entries = self._gathered.report, self._gathered.replica_entries
            self.step = step  # the step the report is labelled with
        elif self._built_over is not self.timing:  # the entries gathered already, built again over the new timing
            self._report = rebuild_report(self._gathered, self.timing, self._groups())
        self._built_over = self.timing
        return self._report

    def _groups(self) -> ReportGroups:
        """The engine's report groups, made on its first report (collective: every rank is in report())."""
        attachment = self.measurement.attachment
        if attachment.report_groups is None:
            attachment.report_groups = ReportGroups.for_layout(self.measurement.layout)
        return attachment.report_groups

    def trace(self, step: Optional[int] = None) -> Optional[dict]:
        """Collective over replica 0 (the others return at once): the Chrome trace on global rank 0, else None."""
        report = self.report(step)
        layout = self.measurement.layout
        if not layout.in_replica:  # the trace shows replica 0 only; its ranks alone gather
            return None
        gathered = gather_replica((dist.get_rank(), self.measurement.events()), layout, self._groups())
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


class _CallingRankOutput:
    """The calling rank prints and writes (DeepSpeed's behaviour for its FlopsProfiler)."""
    emits_here = True

    def emit(self, text: str, output_file: Optional[str] = None) -> None:
        if output_file:
            write_text(text, output_file)
        else:
            print(text, flush=True)

    def write(self, write: Callable[[], None], path: str) -> None:
        write()


class PublishedReports(_CallingRankOutput):
    """Through the store: see the module docstring."""

    def __init__(self, measurement: StageMeasurement):
        self.measurement = measurement
        self._namespace: Optional[str] = None  # the store keys of this rank's measured train_batch
        self._step: Optional[int] = None
        self._collected = None  # (replica entries, samples, collection note, module events by rank)
        self._reports = {}
        self._label: Optional[int] = None  # the step the report is labelled with: the last one asked for

    def start(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        self.forget()
        self._namespace = None
        engine = self.measurement.engine
        self._step = running_iteration(engine.global_steps)  # the iteration as Megatron's log numbers it
        self._label = self._step
        self.measurement.start(ignore_list)
        self.measurement.attachment.publisher = self  # publish() when the measured train_batch returns

    def forget(self) -> None:
        self._collected, self._reports = None, {}

    def publish(self) -> None:
        """The measured train_batch has returned (engine_methods.py): stop, detach everything, then publish this
        rank's part under its own key of the store (never waits)."""
        measurement = self.measurement
        measurement.stop()
        publication = self._publication()
        measurement.detach()  # the measurements stay; no hook or wrapper remains on the engine
        self._namespace = f"engine{measurement.attachment.ordinal}/step{self._step}"
        store_exchange.publish(self._namespace, publication)

    def _publication(self) -> store_exchange.Publication:
        rank, layout = dist.get_rank(), self.measurement.layout
        host, wall_minus_perf_s = store_exchange.this_host_clock()
        try:
            entry = self.measurement.entry().as_dict()
            sample = RankSample.from_entry(entry)
        except Exception as error:  # the readers name this rank and why, instead of waiting for it
            sample = RankSample.failed(rank, layout.stage, layout.tp_rank, layout.dp_rank, error)
            return store_exchange.Publication(rank, sample, None, None, host, wall_minus_perf_s)
        in_replica = layout.in_replica
        return store_exchange.Publication(rank, sample, entry if in_replica else None,
                                          self.measurement.events() if in_replica else None,
                                          host, wall_minus_perf_s)

    def ready(self) -> Optional[dict]:
        """The report, where this rank published (reading the store waits a bounded time only)."""
        return self.report() if self._namespace is not None else None

    def report(self, step: Optional[int] = None) -> dict:
        """Not collective (ProfileIncomplete names what is missing). step only labels the report (DeepSpeed's
        meaning), and the label sticks; at first the iteration measured."""
        step = self._label = self._label if step is None else int(step)
        if step not in self._reports:
            entries, samples, note, _ = self._collect()
            measurement = self.measurement
            context = ReportContext.of(measurement.engine, measurement.layout, step, describe_run(measurement),
                                       skipped_steps_before=measurement.skipped_steps_before,
                                       collection_note=note, clock_note=note)
            self._reports[step] = build_report(entries, context, samples)
        return self._reports[step]

    def _collect(self):
        if self._collected is not None:
            return self._collected
        if self._namespace is None:
            raise ProfileIncomplete(
                "flops profiler: nothing measured on this rank: call start_profile() before the train_batch to "
                "profile (on every rank), and read the profile after that train_batch")
        layout = self.measurement.layout
        collected = store_exchange.collect(self._namespace, store_exchange.world_ranks(),
                                           wait_s=2 * self.measurement.train_batch_s())
        if collected.missing:
            raise ProfileIncomplete(
                f"flops profiler: no whole-pipeline profile of step {self._step}: {_where(collected.missing, layout)} "
                "did not profile that train_batch (call start_profile() on every rank before it)")
        failed = [p for p in collected.found.values() if p.sample.failure]
        if failed:
            raise ProfileIncomplete(
                f"flops profiler: no whole-pipeline profile of step {self._step}: rank {failed[0].global_rank} "
                f"failed building its profile entry: {failed[0].sample.failure}")
        replica = [collected.found[rank] for rank in layout.replica_ranks]
        reference = collected.found[layout.rank_of(0, 0, 0)]
        entries, note = [], SAME_HOST_CLOCK
        for publication in replica:
            entry = dict(publication.entry)
            if publication.host != reference.host:  # one host shares one monotonic clock: no offset there
                entry["clock_offset_s"] = reference.wall_minus_perf_s - publication.wall_minus_perf_s
                note = CROSS_HOST_CLOCKS
            entries.append(entry)
        samples = [collected.found[rank].sample for rank in sorted(collected.found)]
        events = {p.global_rank: p.module_events for p in replica}
        self._collected = (entries, samples, note, events)
        return self._collected

    def trace(self, step: Optional[int] = None) -> dict:
        report = self.report(step)
        entries, _, _, events = self._collect()
        return build_trace(entries, events, report["step"])


class LocalReport(_CallingRankOutput):
    """A plain engine under user code: see the module docstring."""

    def __init__(self, measurement: StageMeasurement):
        self.measurement = measurement
        self._reports = {}
        self._entry: Optional[dict] = None
        self._label: Optional[int] = None  # the step the report is labelled with: the last one asked for

    def start(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        self.forget()
        self.measurement.start(ignore_list)

    def forget(self) -> None:
        self._reports, self._entry, self._label = {}, None, None

    def ready(self) -> Optional[dict]:
        return self.report() if self.measurement.measured else None

    def report(self, step: Optional[int] = None) -> dict:
        measurement = self.measurement
        if not measurement.measured:
            raise ProfileIncomplete("flops profiler: nothing measured on this rank: call start_profile() first")
        if step is not None:
            self._label = int(step)
        elif self._label is None:  # DeepSpeed's label: the engine's steps when the report is first asked for
            self._label = measurement.engine.global_steps
        step = self._label
        if step not in self._reports:
            entry = self._one_rank_entry()
            note = (f"global rank {dist.get_rank()} of {dist.get_world_size()} only: DeepSpeed's FlopsProfiler on a "
                    "plain engine reports the calling rank's model")
            # the calling rank's model: the run's sequence length is its, the whole model's formula is not
            run = RunDescription(seq_length=describe_run(measurement).seq_length)
            context = ReportContext.of(measurement.engine, ONE_RANK, step, run,
                                       skipped_steps_before=measurement.skipped_steps_before, collection_note=note,
                                       micro_batches=entry["instructions"].get("ForwardPass", {}).get("count", 0))
            self._reports[step] = build_report([entry], context)
        return self._reports[step]

    def _one_rank_entry(self) -> dict:
        if self._entry is None:
            entry = self.measurement.entry().as_dict()
            entry.update(global_rank=0, stage_id=0, tp_rank=0, dp_rank=0)  # a one-rank report of this rank
            self._entry = entry
        return self._entry

    def trace(self, step: Optional[int] = None) -> dict:
        report = self.report(step)
        return build_trace([self._one_rank_entry()], {0: self.measurement.events()}, report["step"])


class HeldReport(_CallingRankOutput):
    """A finished report: see the module docstring."""

    def __init__(self, report: dict):
        self._built = report
        self._report = report  # as last labelled

    def forget(self) -> None:
        self._report = self._built

    def ready(self) -> Optional[dict]:
        return self._report

    def report(self, step: Optional[int] = None) -> dict:
        """step only labels the report (DeepSpeed's meaning), and the label sticks: another step gives a
        relabelled copy of the built report (its ranks' entries are not here to build it again)."""
        if step is not None and int(step) != self._report["step"]:
            self._report = self._built if int(step) == self._built["step"] else dict(self._built, step=int(step))
        return self._report

    def trace(self, step: Optional[int] = None) -> dict:
        raise ProfileIncomplete("flops profiler: the config section's profile keeps no trace on this rank; "
                                "profile with --profile-flops-step (pipeline_trace_stepN.json) for one")


# A one-rank report of the calling rank (LocalReport).
ONE_RANK = EngineLayout(0, 0, 0, 1, 1, 1, None, is_pipeline=False)

_PUBLISHED = ("user code drove DeepSpeed's FlopsProfiler: each stage published its measurements through the "
              "process group's store when its train_batch returned; ")
SAME_HOST_CLOCK = _PUBLISHED + "the replica is on one host, whose monotonic clock its ranks share (no alignment needed)"
CROSS_HOST_CLOCKS = _PUBLISHED + ("the replica spans several hosts: their clocks are aligned by the hosts' wall clocks "
                                  "(NTP), whose error is not measured (clock error 0 in the bubble means unmeasured)")


def _where(ranks: List[int], layout: EngineLayout) -> str:
    """'stage 0 (ranks 0, 2)'-style: the stages and ranks of `ranks`."""
    coordinates = {layout.rank_of(s, t, d): s for s in range(layout.pp) for t in range(layout.tp)
                   for d in range(layout.dp)}
    by_stage = {}
    for rank in sorted(ranks):
        by_stage.setdefault(coordinates[rank], []).append(str(rank))
    return "; ".join(f"stage {stage} (rank{'s' if len(members) > 1 else ''} {', '.join(members)})"
                     for stage, members in sorted(by_stage.items()))


def print_report(source: ReportSource, step: Optional[int] = None, output_file: Optional[str] = None,
                 module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> dict:
    """The one way a report reaches its reader: source.report(step) (collective where the source is), formatted
    (printer.format_report's module_depth, top_modules, detailed) on the rank that emits it alone, and printed
    there or written to output_file. Returns the report."""
    report = source.report(step)
    text = format_report(report, module_depth, top_modules, detailed) if source.emits_here else ""
    source.emit(text, output_file)
    return report


def describe_run(measurement: StageMeasurement) -> RunDescription:
    """What the training loop that trains the measured engine says of its run (its door's describe, on the engine's
    attachment), else UNDESCRIBED: for the reports that loop does not ask for itself (the config section's, the
    user's own FlopsProfiler code's, PipelineFlopsProfiler's without a run)."""
    describe = measurement.attachment.describe
    return describe(measurement.engine) if describe is not None else UNDESCRIBED


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
