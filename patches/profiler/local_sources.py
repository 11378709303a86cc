"""The report sources without a collective (sources.py has the collective one, and the protocol they share):

- PublishedReports: each rank that measured a pipeline's train_batch publishes its entry in the process group's
  store when that train_batch returns (store_exchange.py); any rank that asks builds the whole-pipeline report
  from the store, waiting a bounded time for each rank, and prints or writes it itself. DeepSpeed's
  FlopsProfiler(model[0]), driven by user code on any subset of ranks, reports this way.
- LocalReport: a plain DeepSpeedEngine driven by user code: the calling rank's own measurements, as stock
  DeepSpeed reports them.
- HeldReport: a report built elsewhere (the config section's, gathered), held for the getters and prints of
  engine.flops_profiler afterwards, on any rank, with no collective.
"""
from typing import Callable, Iterable, List, Optional

import torch.distributed as dist

from patches.profiler import store_exchange
from patches.profiler.context import ReportContext, RunDescription
from patches.profiler.files import write_text
from patches.profiler.layout import EngineLayout
from patches.profiler.measurement import FinishedMeasurement, StageMeasurement
from patches.profiler.numbering import running_iteration
from patches.profiler.report import build_report
from patches.profiler.sources import ProfileIncomplete, describe_run
from patches.profiler.stragglers import RankSample
from patches.profiler.trace import build_trace


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
        self._wait_s = 0.0  # how long a reader waits for each other rank: twice this rank's measured train_batch
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
        """The measured train_batch has returned (engine_methods.py): the measurement finishes as a schedule's
        does (every hook off the engine, what it measured kept), then this rank's part goes under its own key of
        the store (never waits)."""
        finished = self.measurement.finish()
        self._wait_s = 2 * finished.train_batch_s
        self._namespace = f"engine{self.measurement.attachment.ordinal}/step{self._step}"
        store_exchange.publish(self._namespace, self._publication(finished))

    def _publication(self, finished: FinishedMeasurement) -> store_exchange.Publication:
        rank, layout = dist.get_rank(), self.measurement.layout
        host, wall_minus_perf_s = store_exchange.this_host_clock()
        failure = finished.entry if isinstance(finished.entry, Exception) else None
        if failure is None:
            try:
                entry = finished.entry.as_dict()
                sample = RankSample.from_entry(entry)
            except Exception as error:
                failure = error
        if failure is not None:  # the readers name this rank and why, instead of waiting for it
            sample = RankSample.failed(rank, layout.stage, layout.tp_rank, layout.dp_rank, failure)
            return store_exchange.Publication(rank, sample, None, None, host, wall_minus_perf_s)
        in_replica = layout.in_replica
        return store_exchange.Publication(rank, sample, entry if in_replica else None,
                                          finished.module_events if in_replica else None,
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
                                           wait_s=self._wait_s)
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
        reference = collected.found[layout.stage_leaders[0]]  # whose clock the others are aligned to
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
