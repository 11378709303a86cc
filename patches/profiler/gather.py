"""Getting the report to every rank at a cost that does not grow with data parallelism.

The report describes one data-parallel replica (dp rank 0) in full and every replica by a few
timings (the straggler view), so only replica 0's entries travel:
1. replica 0's ranks align their clocks to global rank 0's (pp x tp ping rounds; no other rank's
   events are placed on a time line);
2. each replica-0 stage's tensor ranks gather their entries to its tp rank 0 (tensor group);
3. those pp ranks gather their stage's entries to global rank 0 (the replica's pipeline group);
4. every rank sends rank 0 one fixed-size RankSample (stragglers.py) with a plain gather;
5. rank 0 builds the report and broadcasts it (or the failure) to every rank.
A non-zero rank thus receives at most its stage's or replica's entries and the report itself; rank 0
holds pp x tp entries and world samples. Every step runs over gloo groups made once, when profiling
starts (ReportGroups.for_layout), and every rank enters every collective of its groups even when it
failed to build its entry, so a failure is named to every rank instead of hanging one.
"""
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from patches.profiler.peaks import peak_tflops_for
from patches.profiler.stragglers import SAMPLE_BYTES, RankSample, error_summary

if TYPE_CHECKING:  # type names only: both modules import this one
    from patches.profiler.engine_hooks import InstructionTimer
    from patches.profiler.module_profiler import ModuleProfiler

# Ping rounds per rank for the clock alignment: the shortest round trip of these bounds the error.
CLOCK_PING_ROUNDS = 8


@dataclass(frozen=True)
class EngineLayout:
    """Where this rank sits in the pp x tp x dp grid, and who sits where (one place for both engines)."""
    stage: int
    tp_rank: int
    dp_rank: int
    pp: int
    tp: int
    dp: int
    topology: object = field(default=None, compare=False, repr=False)  # deepspeed ProcessTopology, or None
    # A PipelineEngine runs a schedule (timed instruction by instruction, inside train_batch); a plain
    # DeepSpeedEngine's forward, backward and step are the iteration. The one place that tells them apart.
    is_pipeline: bool = True

    @classmethod
    def of(cls, engine: DeepSpeedEngine) -> "EngineLayout":
        if isinstance(engine, PipelineEngine):
            grid = engine.grid
            if not hasattr(grid, "_topo"):  # private: the rank layout every report group is built from
                raise RuntimeError("the profiler cannot read this DeepSpeed's pipeline layout: "
                                   "PipelineParallelGrid has no _topo (ProcessTopology)")
            return cls(grid.get_stage_id(), grid.get_slice_parallel_rank(), grid.get_data_parallel_rank(),
                       grid.get_pipe_parallel_world_size(), grid.get_slice_parallel_world_size(),
                       grid.get_data_parallel_world_size(), grid._topo, is_pipeline=True)
        # A plain DeepSpeedEngine is one stage; its mpu (if any) gives the tensor layout.
        mpu = engine.mpu
        tp = mpu.get_model_parallel_world_size() if mpu is not None else 1
        tp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
        dp_rank = mpu.get_data_parallel_rank() if mpu is not None else dist.get_rank()
        topology = mpu.get_topology() if hasattr(mpu, "get_topology") else None
        return cls(0, tp_rank, dp_rank, 1, tp, dist.get_world_size() // tp, topology, is_pipeline=False)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def in_replica(self) -> bool:
        """In the reported replica (dp rank 0)."""
        return self.dp_rank == 0

    def rank_of(self, stage: int, tp_rank: int, dp_rank: int) -> int:
        if self.topology is None:  # no topology: tensor rank fastest, then data (Megatron's order)
            return (stage * self.dp + dp_rank) * self.tp + tp_rank
        coords = {"pipe": stage, "data": dp_rank, "model": tp_rank}
        return self.topology.get_rank(**{axis: coords[axis] for axis in self.topology.axes})

    def tensor_ranks(self, stage: int) -> List[int]:
        """Replica 0's ranks of `stage`, by tp rank."""
        return [self.rank_of(stage, t, 0) for t in range(self.tp)]

    def stage_leaders(self) -> List[int]:
        """Replica 0's tp-rank-0 ranks, by stage."""
        return [self.rank_of(s, 0, 0) for s in range(self.pp)]

    def replica_ranks(self) -> List[int]:
        return [r for s in range(self.pp) for r in self.tensor_ranks(s)]


@dataclass
class RankEntry:
    """One rank's measurements, as build_report and build_trace read them (as_dict)."""
    global_rank: int
    stage_id: int
    tp_rank: int
    dp_rank: int
    modules: dict
    instructions: dict
    train_batch_latency_s: float
    peak_memory_bytes: Optional[int]
    events: list
    uncounted_ops: list = field(default_factory=list)  # ModuleProfiler.uncounted_ops() as dicts
    counted_iteration: Optional[int] = None  # where the FLOPs were counted when not in the profiled iteration
    calls_differ: list = field(default_factory=list)  # ModuleProfiler.adopt_counts(): calls unlike the counted ones
    clock_offset_s: float = 0.0
    clock_error_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunMeta:
    """What the report says about the run as a whole (build_report's `meta`)."""
    step: int
    world_size: int
    pipeline_parallel_size: int
    tensor_parallel_size: int
    data_parallel_size: int
    micro_batches: int
    micro_batch_size: int
    seq_length: Optional[int]
    activation_checkpointing: bool
    analytic: Optional[dict]
    peak_tflops: Optional[float]
    device_name: str
    dtype: str
    # fp16 loss scaling skips the update of a step whose gradients overflowed: timed, but no update
    optimizer_step_skipped: bool = False
    # where the pipeline recomputes fewer layers than the flags ask: which, and why (the caller's one line)
    recompute_note: Optional[str] = None

    @classmethod
    def of(cls, engine: DeepSpeedEngine, layout: EngineLayout, step: int, seq_length: Optional[int] = None,
           analytic: Optional[dict] = None, peak_tflops: Optional[float] = None,
           activation_checkpointing: Optional[bool] = None, device: str = "cpu",
           skipped_steps_before: int = 0, recompute_note: Optional[str] = None) -> "RunMeta":
        if layout.is_pipeline:
            micro_batches = engine.micro_batches
            checkpointing = engine.module.activation_checkpoint_interval > 0
        else:
            micro_batches = engine.gradient_accumulation_steps()
            checkpointing = False
        if activation_checkpointing is not None:  # the caller knows better (Megatron's own checkpointing)
            checkpointing = bool(activation_checkpointing)
        dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        device_name = torch.cuda.get_device_name() if device == "cuda" else device
        peak = peak_tflops if peak_tflops is not None else peak_tflops_for(device_name, dtype)
        return cls(int(step), layout.world_size, layout.pp, layout.tp, layout.dp, micro_batches,
                   engine.train_micro_batch_size_per_gpu(), seq_length, checkpointing, analytic, peak,
                   device_name, dtype, getattr(engine, "skipped_steps", 0) > skipped_steps_before, recompute_note)

    def as_dict(self) -> dict:
        return asdict(self)


def build_rank_entry(layout: EngineLayout, module: torch.nn.Module, module_profiler: "ModuleProfiler",
                     instructions: "InstructionTimer", train_batch_s: float,
                     peak_memory_bytes: Optional[int], counted_iteration: Optional[int] = None,
                     calls_differ: Optional[List[str]] = None) -> RankEntry:
    """This rank's measurements, from its stopped module profiler and instruction timer."""
    tree = module_profiler.tree()
    _annotate_replicated_params(module, tree)
    events = [(name, _plain(kwargs), start, end) for name, kwargs, start, end in instructions.events]
    uncounted = [asdict(op) for op in module_profiler.uncounted_ops()]
    return RankEntry(dist.get_rank(), layout.stage, layout.tp_rank, layout.dp_rank, tree, instructions.as_dict(),
                     train_batch_s, peak_memory_bytes, events, uncounted, counted_iteration, list(calls_differ or []))


def _annotate_replicated_params(module, node):
    """replicated_params: the part of a node's params that every tensor rank holds whole.

    Parameters marked tensor_model_parallel are shards (summed over tensor ranks); the rest
    (LayerNorm, row-parallel biases, position embeddings) are counted once.
    """
    seen = set()

    def visit(mod, tree_node):
        own = 0
        for param in mod.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                if not getattr(param, "tensor_model_parallel", False):
                    own += param.numel()
        children = dict(mod.named_children())
        total = own
        for child_node in tree_node["children"]:
            child = children.get(child_node["name"])
            if child is not None:
                total += visit(child, child_node)
        tree_node["replicated_params"] = total
        return total

    visit(module, node)


def _plain(kwargs):
    return {key: value for key, value in kwargs.items() if isinstance(value, (int, float, str, bool))}


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
        """Collective: every rank enters the same new_group calls in the same order. Made once per
        process group and layout; profiling the same engine again reuses them."""
        # the replica's rank grid decides every group (the topology's axis order included)
        key = (id(dist.group.WORLD), layout.world_size, tuple(tuple(layout.tensor_ranks(s)) for s in range(layout.pp)))
        if key not in _GROUPS:
            rank = dist.get_rank()
            world = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            tensor = None
            if layout.tp > 1:
                for stage in range(layout.pp):
                    ranks = layout.tensor_ranks(stage)
                    group = dist.new_group(ranks=ranks, backend="gloo")
                    if rank in ranks:
                        tensor = group
            ranks = layout.stage_leaders()
            leaders = dist.new_group(ranks=ranks, backend="gloo")
            _GROUPS[key] = cls(world, tensor, leaders if rank in ranks else None)
        return _GROUPS[key]


_GROUPS = {}


def forget_report_groups() -> None:
    """Drop the cached report groups (after destroy_process_group): a gloo group's worker threads end with
    its last reference, which must go before the interpreter finalizes."""
    _GROUPS.clear()


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


def gather_report(layout: EngineLayout, groups: ReportGroups, build_entry: Callable[[], RankEntry],
                  build_meta: Callable[[], RunMeta], build: Callable[..., dict]) -> GatherResult:
    """Collective over every rank. build_entry() makes this rank's RankEntry (it may raise);
    rank 0 calls build(replica entries, meta dict, samples) and every rank returns its result."""
    rank = dist.get_rank()
    offset, error = 0.0, 0.0
    if layout.in_replica:
        offset, error = measure_clock_offset(group=groups.world, ranks=layout.replica_ranks())
    failure, entry, payload = None, None, None
    try:
        entry = build_entry()
        entry.clock_offset_s, entry.clock_error_s = offset, error
        payload = entry.as_dict()
        sample = RankSample.from_entry(payload)
    except Exception as e:  # every collective below is still entered: the others learn who failed
        failure = e
        payload = _Failure(rank, error_summary(e))
        sample = RankSample.failed(rank, layout.stage, layout.tp_rank, layout.dp_rank, e)

    replica = gather_replica(payload, layout, groups) if layout.in_replica else None
    samples = _gather_samples(sample, groups.world, layout.world_size)

    outcome = [None]
    if rank == 0:
        outcome[0], build_error = _outcome(replica, samples, build_meta, build)
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
    return GatherResult(value, replica if rank == 0 else None)


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
    mine = torch.frombuffer(bytearray(sample.to_bytes()), dtype=torch.uint8)
    buffers = [torch.empty(SAMPLE_BYTES, dtype=torch.uint8) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(mine, buffers, dst=0, group=group)
    if buffers is None:
        return None
    return [RankSample.from_bytes(bytes(b.numpy())) for b in buffers]


def _outcome(replica, samples, build_meta, build):
    """(('ok', report) or ('error', (message, failed ranks, reason)), rank 0's own error or None)."""
    failed = sorted(s.global_rank for s in samples if s.failure is not None)
    if failed:
        first = next(s for s in samples if s.global_rank == failed[0])
        who = f"rank {failed[0]}" if len(failed) == 1 else "ranks " + ", ".join(map(str, failed))
        reason = f"building its profile entry: {first.failure}"
        return ("error", (f"the profile report was not built: {who} failed {reason}", failed, reason)), None
    try:
        return ("ok", build(replica, build_meta().as_dict(), samples)), None
    except Exception as e:
        reason = f"building the profile report: {error_summary(e)}"
        return ("error", (f"the profile report was not built: rank 0 failed {reason}", [0], reason)), e
