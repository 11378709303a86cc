"""Moving the measurements: getting the report to every rank at a cost that does not grow with data parallelism.

The report describes one data-parallel replica (dp rank 0) in full and every replica by a few
timings (the straggler view), so only replica 0's entries travel:
0. on a CPU, every rank measures how much the ranks slow each other computing at once (host_contention.py);
1. replica 0's ranks align their clocks to global rank 0's (pp x tp ping rounds; no other rank's
   events are placed on a time line);
2. each replica-0 stage's tensor ranks gather their entries to its tp rank 0 (tensor group);
3. those pp ranks gather their stage's entries to global rank 0 (the replica's pipeline group);
4. every rank sends rank 0 one fixed-size RankSample (stragglers.py) with a plain gather;
5. rank 0 builds the report (report.build_report) and broadcasts it (or the failure) to every rank.
A non-zero rank thus receives at most its stage's or replica's entries and the report itself; rank 0
holds pp x tp entries and world samples. Every step runs over gloo groups made once
(ReportGroups.for_layout), and every rank enters every collective of its groups even when it
failed to build its entry, so a failure is named to every rank instead of hanging one.
"""
import time
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from patches.profiler.context import IterationTiming, ReportContext
from patches.profiler.entry import RankEntry
from patches.profiler.host_contention import together_rate
from patches.profiler.layout import EngineLayout
from patches.profiler.report import build_report
from patches.profiler.stragglers import SAMPLE_BYTES, RankSample, error_summary

# Ping rounds per rank for the clock alignment: the shortest round trip of these bounds the error.
CLOCK_PING_ROUNDS = 8


class ReportError(RuntimeError):
    """The report could not be built because of `failed_ranks` (named in the message)."""

    def __init__(self, message: str, failed_ranks: List[int], reason: str):
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.reason = reason


@dataclass
class ReportGroups:
    """The gloo groups the report uses; None where the default group serves (or this rank is not in it)."""
    world: object  # every rank, for the samples, the broadcast and the clock pings
    tensor: object  # this replica-0 stage's tp ranks
    leaders: object  # replica 0's tp-rank-0 ranks, one per stage

    @classmethod
    def for_layout(cls, layout: EngineLayout) -> "ReportGroups":
        """Collective: every rank enters the same new_group calls in the same order. Made once per engine (its
        attachment keeps them: profiling the same engine again reuses them, and they go with it)."""
        rank = dist.get_rank()
        world = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        tensor = None
        if layout.tp > 1:
            for stage in range(layout.pp):
                ranks = layout.tensor_ranks(stage)
                group = dist.new_group(ranks=ranks, backend="gloo")
                if rank in ranks:
                    tensor = group
        ranks = list(layout.stage_leaders)
        leaders = dist.new_group(ranks=ranks, backend="gloo")
        return cls(world, tensor, leaders if rank in ranks else None)


def measure_clock_offset(rounds: int = CLOCK_PING_ROUNDS, clock: Callable[[], float] = time.perf_counter,
                         group: Optional[dist.ProcessGroup] = None,
                         ranks: Optional[List[int]] = None) -> Tuple[float, float]:
    """(offset, error): this rank's `clock` minus global rank 0's, in seconds.

    Collective over `ranks` (default: every rank), which must include 0; `group` is a gloo group
    holding them (None: the default group, which must then be gloo). The ranks take turns pinging
    rank 0 `rounds` times: the rank reads its clock (a), sends, rank 0 answers with its own clock
    read on receipt (t0), the rank reads its clock again (b). t0 was read between a and b, so the
    offset lies in [a - t0, b - t0]: the midpoint is taken, wrong by at most (b - a) / 2; the round
    with the shortest round trip is kept. Host clocks over gloo, so no device queue sits between a
    clock read and a message. Drift over the seconds since the profiled step is ignored.
    """
    if group is None and dist.get_backend() != "gloo":
        raise ValueError("measure_clock_offset needs a gloo group (ReportGroups.for_layout makes one)")
    rank = dist.get_rank()
    peers = [r for r in (ranks if ranks is not None else range(dist.get_world_size())) if r != 0]
    message = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        for peer in peers:
            for _ in range(rounds):
                dist.recv(message, src=peer, group=group)
                message[0] = clock()
                dist.send(message, dst=peer, group=group)
        return 0.0, 0.0
    best = (0.0, float("inf"))
    for _ in range(rounds):
        before = clock()
        dist.send(message, dst=0, group=group)
        dist.recv(message, src=0, group=group)
        after = clock()
        error = (after - before) / 2
        if error < best[1]:
            best = ((before + after) / 2 - message.item(), error)
    return best


@dataclass
class _Failure:
    """What a rank sends in place of its entry when building it raised."""
    global_rank: int
    summary: str


@dataclass
class GatherResult:
    report: dict
    replica_entries: Optional[List[dict]]  # on global rank 0 only: replica 0's entries (for the trace)
    samples: Optional[List[RankSample]] = None  # on global rank 0 only: every rank's sample (rebuild_report)
    context: Optional[ReportContext] = None  # on global rank 0 only: what the report was built with


def gather_report(layout: EngineLayout, groups: ReportGroups, entry: Union[RankEntry, Exception],
                  context: ReportContext) -> GatherResult:
    """Collective over every rank. entry: this rank's RankEntry, or the error that building it raised (every
    collective is still entered, so the others learn who failed). Rank 0 builds the report with its own
    context; every rank returns that report (or raises the failure, naming the rank)."""
    rank = dist.get_rank()
    offset, error = 0.0, 0.0
    # CPU ranks slow each other when they compute at once: measured by every rank alike (the device is the same)
    rate = together_rate(groups.world) if context.device_name == "cpu" else None
    if layout.in_replica:
        offset, error = measure_clock_offset(group=groups.world, ranks=list(layout.replica_ranks))
    failure, payload = None, None
    if isinstance(entry, Exception):
        failure = entry
    else:
        try:
            entry.clock_offset_s, entry.clock_error_s = offset, error
            entry.together_rate = rate
            payload = entry.as_dict()
            sample = RankSample.from_entry(payload)
        except Exception as e:
            failure = e
    if failure is not None:
        payload = _Failure(rank, error_summary(failure))
        sample = RankSample.failed(rank, layout.stage, layout.tp_rank, layout.dp_rank, failure)

    replica = gather_replica(payload, layout, groups) if layout.in_replica else None
    samples = _gather_samples(sample, groups.world, layout.world_size)

    outcome = [None]
    if rank == 0:
        outcome[0], build_error = _outcome(replica, samples, context)
        failure = failure or build_error
    dist.broadcast_object_list(outcome, src=0, group=groups.world)
    kind, value = outcome[0]
    if failure is not None:  # this rank's own error, as raised, carrying what every other rank was told
        if kind == "error":
            failure.failed_ranks, failure.reason = value[1], value[2]
        raise failure
    if kind == "error":
        message, failed, reason = value
        raise ReportError(message, failed, reason)
    if rank == 0:
        return GatherResult(value, replica, samples, context)
    return GatherResult(value, None)


def rebuild_report(gathered: GatherResult, timing: IterationTiming, groups: ReportGroups) -> dict:
    """Collective over every rank: the report rank 0 gathered, built again over another timing (its entries and
    samples as gathered), broadcast. A failure here is rank 0's alone and reaches every rank."""
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = ("ok", build_report(gathered.replica_entries, replace(gathered.context, timing=timing),
                                             gathered.samples))
        except Exception as e:
            outcome[0] = ("error", f"the profile report was not built again: rank 0 failed: {error_summary(e)}")
    dist.broadcast_object_list(outcome, src=0, group=groups.world)
    kind, value = outcome[0]
    if kind == "error":
        raise ReportError(value, [0], value)
    return value


def gather_replica(payload: object, layout: EngineLayout, groups: ReportGroups) -> Optional[List[object]]:
    """Collective over replica 0's ranks only (the others must not call it): every payload on global
    rank 0, in (stage, tp rank) order; None elsewhere. Each stage's tensor ranks gather to its tp
    rank 0, then those gather to rank 0, so no rank receives more than its replica's payloads."""
    stage_payloads = [payload]
    if layout.tp > 1:
        gathered = [None] * layout.tp if layout.tp_rank == 0 else None
        dist.gather_object(payload, gathered, dst=layout.rank_of(layout.stage, 0, 0), group=groups.tensor)
        stage_payloads = gathered
    if layout.tp_rank != 0:
        return None
    per_stage = [None] * layout.pp if dist.get_rank() == 0 else None
    dist.gather_object(stage_payloads, per_stage, dst=0, group=groups.leaders)
    if per_stage is None:
        return None
    return [p for stage in per_stage for p in stage]


def _gather_samples(sample: RankSample, group, world: int) -> Optional[List[RankSample]]:
    """Every rank's sample on rank 0 (a gather: the others receive nothing)."""
    # a tensor of its own memory, not a view of a Python buffer: gloo's worker thread may drop it after this
    # returns, and dropping a buffer Python owns takes the GIL (fatal once the interpreter finalizes)
    mine = torch.tensor(bytearray(sample.to_bytes()), dtype=torch.uint8)
    buffers = [torch.empty(SAMPLE_BYTES, dtype=torch.uint8) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(mine, buffers, dst=0, group=group)
    if buffers is None:
        return None
    return [RankSample.from_bytes(bytes(b.numpy())) for b in buffers]


def _outcome(replica, samples, context):
    """(('ok', report) or ('error', (message, failed ranks, reason)), rank 0's own error or None)."""
    failed = sorted(s.global_rank for s in samples if s.failure is not None)
    if failed:
        first = next(s for s in samples if s.global_rank == failed[0])
        reason = f"building its profile entry: {first.failure}"
        return ("error", (_not_built(failed, reason), failed, reason)), None
    try:
        return ("ok", build_report(replica, context, samples)), None
    except Exception as e:
        reason = f"building the profile report: {error_summary(e)}"
        return ("error", (_not_built([0], reason), [0], reason)), e


def _not_built(failed: List[int], reason: str) -> str:
    who = f"rank {failed[0]}" if len(failed) == 1 else "ranks " + ", ".join(map(str, failed))
    return f"the profile report was not built: {who} failed {reason}"


def not_built_line(error: BaseException) -> Optional[str]:
    """What every rank says where a report could not be built (gather_report's or rebuild_report's ReportError, or
    the failing rank's own error, which gather_report names to it); None for an error of any other kind (a broken
    connection is the run's failure, not the report's)."""
    if isinstance(error, ReportError):
        return str(error)
    failed = getattr(error, "failed_ranks", None)
    return _not_built(failed, error.reason) if failed else None
