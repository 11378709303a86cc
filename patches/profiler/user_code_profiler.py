"""DeepSpeed's FlopsProfiler as user code drives it, made true for a PipelineEngine.

    prof = FlopsProfiler(model[0])    # after patches.apply(); model[0] a PipelineEngine (or its PipelineModule)
    prof.start_profile()              # on every rank, before the profiled train_batch
    engine.train_batch(data_iter)     # each rank that started measures its stage, and stops when it returns
    prof.print_model_profile(...)     # on any one rank (or several): the whole pipeline
    prof.end_profile()

A rank that started profiles its stage through the next train_batch only: forward, backward and
recompute per module, every schedule instruction timed. When that train_batch returns, the rank
removes every hook and publishes its measurements under its own key of the process group's store
(store_exchange.py); nothing it does waits for another rank. A rank that asks for the report (any
getter, a print, write_json) reads the other ranks' publications, waiting a bounded time for each:
stages that did not profile are named in one line instead of a report, never waited on forever. No
collective is entered, so no subset of ranks driving this API can leave one half-entered.

On a plain DeepSpeedEngine (engine.flops_profiler, with the config section on) the user's own start /
stop / print, on any ranks, report the calling rank's measurements, as stock DeepSpeed's does.
The config section's own profile (flops_profiler_config.py) is gathered collectively, at a point
every rank passes, through gather_report.
"""
import sys
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler
from deepspeed.runtime.engine import DeepSpeedEngine

from patches.flops_profiler_class import engine_ordinal, pipeline_engine_of
from patches.profiler import store_exchange
from patches.profiler.files import write_json, write_text, write_trace
from patches.profiler.gather import EngineLayout, RunMeta
from patches.profiler.pipeline_profiler import PipelineFlopsProfiler
from patches.profiler.printer import format_aggregated, format_report
from patches.profiler.report import build_report
from patches.profiler.stragglers import RankSample
from patches.profiler.trace import build_trace


class ProfileIncomplete(RuntimeError):
    """The whole-pipeline report cannot be built: the message names what is missing (one line)."""


class UserCodeFlopsProfiler(PipelineFlopsProfiler, FlopsProfiler):
    """DeepSpeed's FlopsProfiler API (an instance of it) on any subset of ranks; see the module docstring."""

    def __init__(self, model: torch.nn.Module, ds_engine: Optional[DeepSpeedEngine] = None,
                 recompute_fwd_factor: float = 0.0):
        engine = pipeline_engine_of(model, ds_engine)
        if engine is None:
            engine = model if isinstance(model, DeepSpeedEngine) else ds_engine
        if not isinstance(engine, DeepSpeedEngine):
            raise TypeError("UserCodeFlopsProfiler profiles a DeepSpeed engine (or a PipelineModule of one); "
                            f"got {type(model).__name__}: use DeepSpeed's FlopsProfiler for a plain module")
        PipelineFlopsProfiler.__init__(self, engine)
        # DeepSpeed's FlopsProfiler attributes
        self.model, self.ds_engine, self.recompute_fwd_factor, self.func_patched = model, engine, \
            recompute_fwd_factor, False
        self._namespace: Optional[str] = None  # the store keys of this rank's profiled train_batch
        self._step: Optional[int] = None
        self._events = None  # replica 0's module events by global rank, for write_trace

    # ------------------------------------------------------------------ measuring
    def start_profile(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        """Local. On a pipeline, this rank measures its stage through the next train_batch, then detaches."""
        if self.started:
            return
        self._report, self._namespace, self._events = None, None, None
        self.counting_pass = None  # user code profiles one train_batch: its FLOPs are counted in it
        self._step = self.engine.global_steps + 1  # the iteration as Megatron's log numbers it
        self.start_measuring(ignore_list, self._publish if self.layout.is_pipeline else None)

    def _publish(self) -> None:
        """Called when the profiled train_batch returns: detach everything, then publish (never waits)."""
        self.stop_profile()
        publication = self._publication()
        self.end_profile()  # the measurements stay; no hook, wrapper or flag remains on the engine
        self._namespace = f"engine{engine_ordinal(self.engine)}/step{self._step}"
        store_exchange.publish(self._namespace, publication)

    def _publication(self) -> store_exchange.Publication:
        rank = dist.get_rank()
        host, wall_minus_perf_s = store_exchange.this_host_clock()
        try:
            entry = self.rank_entry().as_dict()
            sample = RankSample.from_entry(entry)
        except Exception as error:  # the readers name this rank and why, instead of waiting for it
            layout = self.layout
            sample = RankSample.failed(rank, layout.stage, layout.tp_rank, layout.dp_rank, error)
            return store_exchange.Publication(rank, sample, None, None, host, wall_minus_perf_s)
        in_replica = self.layout.in_replica
        return store_exchange.Publication(rank, sample, entry if in_replica else None,
                                          self.module_profiler.events() if in_replica else None,
                                          host, wall_minus_perf_s)

    # ------------------------------------------------------------------ the report
    def gather_report(self, profile_step: Optional[int] = None) -> dict:
        """Collective (every rank calls it): the config section's profile, gathered as PipelineFlopsProfiler
        gathers it. Afterwards the getters and prints of this object show that report on every rank."""
        return PipelineFlopsProfiler.get_report(self, profile_step)

    def get_report(self, profile_step: Optional[int] = None) -> dict:
        """Not collective: the report this rank gathered, read or measured (ProfileIncomplete names what is
        missing). profile_step only labels the report (DeepSpeed's meaning)."""
        if self._report is None:
            if self.layout.is_pipeline:
                self._report = self._read_published_report()
            else:
                self._report = self._this_rank_report()
            self.flops, self.macs, self.params = self.get_total_flops(), self.get_total_macs(), self.get_total_params()
        if profile_step is not None:
            self._report["step"] = int(profile_step)
        return self._report

    def _read_published_report(self) -> dict:
        if self._namespace is None:
            raise ProfileIncomplete(
                "flops profiler: nothing measured on this rank: call start_profile() before the train_batch to "
                "profile (on every rank), and read the profile after that train_batch")
        layout = self.layout
        collected = store_exchange.collect(self._namespace, store_exchange.world_ranks(),
                                           wait_s=2 * self.hooks.train_batch_s())
        if collected.missing:
            raise ProfileIncomplete(
                f"flops profiler: no whole-pipeline profile of step {self._step}: {_where(collected.missing, layout)} "
                "did not profile that train_batch (call start_profile() on every rank before it)")
        failed = [p for p in collected.found.values() if p.sample.failure]
        if failed:
            raise ProfileIncomplete(
                f"flops profiler: no whole-pipeline profile of step {self._step}: rank {failed[0].global_rank} "
                f"failed building its profile entry: {failed[0].sample.failure}")
        replica = [collected.found[rank] for rank in layout.replica_ranks()]
        reference = collected.found[layout.rank_of(0, 0, 0)]
        entries, note = [], None
        for publication in replica:
            entry = dict(publication.entry)
            if publication.host != reference.host:  # one host shares one monotonic clock: no offset there
                entry["clock_offset_s"] = reference.wall_minus_perf_s - publication.wall_minus_perf_s
                note = CROSS_HOST_CLOCKS
            entries.append(entry)
        meta = self._meta(layout, self._step, note or SAME_HOST_CLOCK)
        samples = [collected.found[rank].sample for rank in sorted(collected.found)]
        report = build_report(entries, meta, samples)
        report["notes"]["clock_sync"] = meta["collection_note"]  # no ping rounds ran on this path
        self._entries = entries
        self._events = {p.global_rank: p.module_events for p in replica}
        return report

    def _this_rank_report(self) -> dict:
        """A plain engine: the calling rank's own measurements, as stock DeepSpeed reports them."""
        if self.module_profiler is None:
            raise ProfileIncomplete("flops profiler: nothing measured on this rank: call start_profile() first")
        entry = self.rank_entry().as_dict()
        entry.update(global_rank=0, stage_id=0, tp_rank=0, dp_rank=0)  # a one-rank report of this rank
        one_rank = EngineLayout(0, 0, 0, 1, 1, 1, None, is_pipeline=False)
        note = (f"global rank {dist.get_rank()} of {dist.get_world_size()} only: DeepSpeed's FlopsProfiler on a "
                "plain engine reports the calling rank's model")
        meta = self._meta(one_rank, self.engine.global_steps, note)
        meta["micro_batches"] = entry["instructions"].get("ForwardPass", {}).get("count", 0)  # those that ran
        self._entries = [entry]
        self._events = {0: self.module_profiler.events()}
        return build_report([entry], meta)

    def _meta(self, layout: EngineLayout, step: int, collection_note: Optional[str]) -> dict:
        meta = RunMeta.of(self.engine, layout, step, device=self.accelerator.device_name(),
                          skipped_steps_before=self._skipped_steps_before).as_dict()
        meta["collection_note"] = collection_note
        return meta

    def _totals(self):
        if self._report is None and (self._namespace is not None or
                                     (not self.layout.is_pipeline and self.module_profiler is not None)):
            self.get_report()
        return PipelineFlopsProfiler._totals(self)

    # ------------------------------------------------------------------ DeepSpeed's printing API
    def print_model_profile(self, profile_step: Optional[int] = None, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: Optional[str] = None) -> None:
        """On the calling rank (DeepSpeed's behaviour): the whole pipeline, or one line naming what is missing."""
        try:
            report = self.get_report(profile_step)
        except ProfileIncomplete as missing:
            print(str(missing), file=sys.stderr, flush=True)
            return
        text = format_report(report, module_depth=module_depth, top_modules=top_modules, detailed=detailed)
        if output_file:
            write_text(text, output_file)
        else:
            print(text, flush=True)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """The top modules per depth of the whole model (the report's Aggregated Profile), on the calling rank."""
        try:
            report = self.get_report()
        except ProfileIncomplete as missing:
            print(str(missing), file=sys.stderr, flush=True)
            return
        print("\n".join(format_aggregated(report, module_depth, top_modules)), flush=True)

    def print_gathered(self, module_depth: int, top_modules: int, detailed: bool,
                       output_file: Optional[str]) -> None:
        """Collective, after gather_report: rank 0 prints; an output_file error reaches every rank
        (ReportWriteError)."""
        PipelineFlopsProfiler.print_model_profile(self, None, module_depth, top_modules, detailed, output_file)

    def write_json(self, path: str, profile_step: Optional[int] = None) -> None:
        """The calling rank writes the report's JSON."""
        write_json(self.get_report(profile_step), path)

    def write_trace(self, path: str, profile_step: Optional[int] = None) -> None:
        """The calling rank writes the Chrome trace of the reported replica."""
        report = self.get_report(profile_step)
        write_trace(build_trace(self._entries, self._events, report["step"]), path)


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
