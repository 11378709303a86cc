"""Where to cut a pipeline: the contiguous partition of a PipelineModule's layers that a measured run says is best.

A report's `layers` (table.py) hold each layer's measured forward, backward and recompute seconds per
iteration, on the stage that ran it; each stage's `overhead_s` is the work of its ForwardPass and
BackwardPass instructions that no layer accounts for (the loss on the last stage, the stage module's own
glue). The plan:

1. costs: each layer's seconds, as measured; each stage position keeps its overhead (the loss stays on
   the last stage whatever layers it gets);
2. the partition: contiguous, no stage empty, minimising the largest stage load (a stage's per-iteration
   compute, the bound of DeepSpeed's 1F1B schedule); among partitions with the same bound, the one whose
   loads, sorted from the largest, are the smallest (so the second-slowest stage is as fast as it can be,
   and so on); then the earliest boundaries;
3. the prediction, by DeepSpeed's 1F1B schedule with m micro-batches and per-micro-batch stage times t_s:
   one micro-batch crosses every stage forward and backward, and the other m - 1 follow at the pace of the
   slowest stage: model(t) = sum(t_s) + (m - 1) * max(t_s). What the model leaves out (messages, the
   optimizer step, loading data) is the measured iteration's time minus the model of the partition that
   ran, and is added unchanged: predicted = model(new) + (measured - model(current)). Where a CPU run's ranks
   share fewer CPUs than they run threads (SharedCpus, measured), a stage's time holds its waits for a core:
   model(t) is then the same schedule run on the CPUs they share (shared_schedule.py), each stage's work its
   measured time less those waits.

Under a memory limit (a report with memory terms, memory_model.py), the partition is the best of those whose every
stage's predicted peak is within the limit (memory_bounded_parts): a stage's peak depends only on its layers and
its position, so each candidate stage is kept or refused on its own inside the same dynamic programme. Where no
partition fits, the plan is the one whose largest peak is the smallest (least_peak_parts), balanced among
those, with by how much it exceeds.

The plan of a saved report is report_plan.py's; its lines, plan_lines.py's.
"""
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from patches.partition.shared_schedule import shared_cpus_iter_s

DEVICE = "device"  # a limit's source: the accelerator's total memory (the others: 'flag', 'environment')
# peak(stage, first, stop): the predicted memory peak of stage `stage` holding layers first .. stop - 1
PeakOf = Callable[[int, int, int], int]
# load(stage, first, stop): stage `stage`'s load holding layers first .. stop - 1, or None where it may not
LoadOf = Callable[[int, int, int], Optional[float]]


@dataclass(frozen=True)
class LayerCost:
    """One layer of a PipelineModule as one iteration of a run measured it."""
    index: int  # its place in the PipelineModule's layer list
    type: str
    stage: int  # the stage that ran it
    seconds: float  # forward + backward + recompute, per iteration


@dataclass(frozen=True)
class Plan:
    """A partition of the layers over the stages, and what it predicts."""
    parts: List[int]  # DeepSpeed's PipelineModule.parts: stage s holds layers parts[s] .. parts[s + 1] - 1
    stage_s: List[float]  # each stage's compute per iteration: its layers and its position's overhead
    bound_s: float  # the largest stage_s
    predicted_iter_s: float
    predicted_bubble: float  # each stage's idle fraction, averaged: 1 - mean(stage_s) / predicted_iter_s


def _loads(costs, parts, overheads):
    return [sum(costs[parts[s]:parts[s + 1]]) + overheads[s] for s in range(len(parts) - 1)]


def cheapest_parts(load_of: LoadOf, layers: int, stages: int) -> Optional[List[int]]:
    """The contiguous partition of `layers` layers into `stages` non-empty parts whose loads, sorted from the
    largest, are lexicographically smallest: the largest load as small as it can be, then the second largest, and
    so on; ties broken by the earliest boundaries. load_of(stage, first, stop): that stage's load holding layers
    first .. stop - 1, or None where it may not hold them; None where no partition may be made."""
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot cut {layers} layers into {stages} non-empty stages")
    # best[k][i]: (the sorted-descending loads, the boundaries) of the first i layers cut into k stages
    best: List[List[Optional[Tuple[tuple, tuple]]]] = [[None] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = ((), (0,))
    for k in range(1, stages + 1):
        for i in range(k, layers - (stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] is None:
                    continue
                load = load_of(k - 1, j, i)
                if load is None:
                    continue
                loads, bounds = best[k - 1][j]
                candidate = (tuple(sorted(loads + (load,), reverse=True)), bounds + (i,))
                if best[k][i] is None or candidate < best[k][i]:
                    best[k][i] = candidate
    return list(best[stages][layers][1]) if best[stages][layers] is not None else None


def balanced_parts(costs: Sequence[float], stages: int, overheads: Optional[Sequence[float]] = None,
                   fits: Optional[Callable[[int, int, int], bool]] = None) -> Optional[List[int]]:
    """cheapest_parts of a part's costs plus its position's overhead. fits(stage, first, stop): whether that stage
    may hold costs first .. stop - 1 (None: any); with it, the best of the partitions whose every stage fits, or
    None where none does."""
    overheads = list(overheads) if overheads is not None else [0.0] * stages
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def load_of(stage: int, first: int, stop: int) -> Optional[float]:
        if fits is not None and not fits(stage, first, stop):
            return None
        return prefix[stop] - prefix[first] + overheads[stage]

    return cheapest_parts(load_of, len(costs), stages)


def least_peak_parts(peak: PeakOf, layers: int, stages: int) -> Tuple[List[int], int]:
    """(parts, peak): the contiguous partition of `layers` layers into `stages` non-empty stages whose largest
    peak(stage, first, stop) is the smallest, and that peak; ties broken by the earliest boundaries."""
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot cut {layers} layers into {stages} non-empty stages")
    # best[k][i]: (the largest peak, the boundaries) of the first i layers cut into k stages
    best: List[List[Optional[Tuple[int, tuple]]]] = [[None] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0, (0,))
    for k in range(1, stages + 1):
        for i in range(k, layers - (stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] is None:
                    continue
                largest, bounds = best[k - 1][j]
                candidate = (max(largest, peak(k - 1, j, i)), bounds + (i,))
                if best[k][i] is None or candidate < best[k][i]:
                    best[k][i] = candidate
    largest, bounds = best[stages][layers]
    return list(bounds), largest


def memory_bounded_parts(costs: Sequence[float], stages: int, overheads: Optional[Sequence[float]], peak: PeakOf,
                         limit: int) -> Tuple[List[int], Optional[int]]:
    """(parts, excess): balanced_parts among the partitions whose every stage's peak is at most `limit`, excess
    None; where none is, balanced_parts among those whose largest peak is the smallest there is, and by how many
    bytes that peak exceeds the limit."""
    parts = balanced_parts(costs, stages, overheads, fits=lambda stage, first, stop: peak(stage, first, stop) <= limit)
    if parts is not None:
        return parts, None
    _, least = least_peak_parts(peak, len(costs), stages)
    parts = balanced_parts(costs, stages, overheads, fits=lambda stage, first, stop: peak(stage, first, stop) <= least)
    return parts, least - limit


@dataclass(frozen=True)
class SharedCpus:
    """A CPU run whose ranks share fewer CPUs than they run threads, or whose CPUs slow each other when busy at once
    (measured: profiler/shared_cpus.py): a stage's measured time holds its waits for a core and its slowdown, and a
    cut that keeps more stages busy at once slows each of them. `share` of the stages' compute time they did at
    full speed, the rest waiting for a core or slowed."""
    cpus: int  # the CPUs the host's ranks may run on (the same for each)
    ranks: int  # the job's ranks on the host
    threads: int  # torch's threads per rank
    ranks_per_stage: int  # tensor x data parallel ranks: each runs its stage's time
    share: float
    # the forward instructions' part of that compute time; None in a report from before it was measured: a third
    # (a backward about twice its forward)
    forward_share: Optional[float] = None
    # a thread's speed with every rank of the host computing over its speed alone (profiler/host_contention.py);
    # None in a report from before it was measured: 1
    together_rate: Optional[float] = None
    # each stage's `share`, applied to its layers' and overhead's measured seconds where they are read
    # (MeasuredRun.stage_scale); None in a report from before: `share`, applied to each stage's time here
    stage_shares: Optional[List[float]] = None

    @property
    def together_threads(self) -> int:
        """The threads the host's CPUs run when every rank computes: where together_rate was measured."""
        return min(self.ranks * self.threads, self.cpus)

    def micro_batch_work_s(self, stage_s: Sequence[float], micro_batches: int) -> Tuple[List[float], List[float]]:
        """Each stage's forward and backward work for one micro-batch at a whole core per thread: its measured time
        less the waits for a core and the slowdown (already taken out where stage_shares are), split as the run's
        compute was."""
        forward = self.forward_share if self.forward_share is not None else 1 / 3
        share = self.share if self.stage_shares is None else 1.0
        return ([seconds * share * forward / micro_batches for seconds in stage_s],
                [seconds * share * (1 - forward) / micro_batches for seconds in stage_s])

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of_dict(cls, stored: Optional[dict]) -> Optional["SharedCpus"]:
        """From a report's plan basis (None there: the CPUs were not shared, or a report from before they were
        measured)."""
        return cls(**stored) if stored else None


def model_iter_s(stage_s: Sequence[float], micro_batches: int, cpus: Optional[SharedCpus] = None) -> float:
    """DeepSpeed's 1F1B: one micro-batch through every stage, the other m - 1 at the slowest stage's pace; where the
    ranks share too few CPUs (cpus), the same schedule on the CPUs they share (shared_schedule.py)."""
    if cpus is not None:
        forward, backward = cpus.micro_batch_work_s(stage_s, micro_batches)
        together = cpus.together_rate if cpus.together_rate is not None else 1.0
        return shared_cpus_iter_s(forward, backward, micro_batches, cpus.cpus, cpus.threads * cpus.ranks_per_stage,
                                  together, cpus.together_threads)
    per_micro_batch = [seconds / micro_batches for seconds in stage_s]
    return sum(per_micro_batch) + (micro_batches - 1) * max(per_micro_batch)


def plan(layers: Sequence[LayerCost], current_parts: Sequence[int], overhead_s: Sequence[float],
         measured_iter_s: float, micro_batches: int, stages: Optional[int] = None, peak: Optional[PeakOf] = None,
         limit: Optional[int] = None, cpus: Optional[SharedCpus] = None) -> Plan:
    """The best contiguous partition of `layers` (in index order) into `stages` (default: as many as ran), and the
    iteration time it predicts (see the module docstring). overhead_s: each stage position's compute that no
    layer accounts for, as measured (for another number of stages, see overheads_for). peak and limit: the best
    of those whose every stage's peak is within the limit (memory_bounded_parts). cpus: as model_iter_s's."""
    costs = [layer.seconds for layer in sorted(layers, key=lambda layer: layer.index)]
    stages = stages or len(current_parts) - 1
    overheads = overheads_for(overhead_s, stages)
    if peak is not None and limit is not None:
        parts, _ = memory_bounded_parts(costs, stages, overheads, peak, limit)
    else:
        parts = balanced_parts(costs, stages, overheads)
    return predict(layers, current_parts, overhead_s, measured_iter_s, micro_batches, parts, cpus)


def predict(layers: Sequence[LayerCost], current_parts: Sequence[int], overhead_s: Sequence[float],
            measured_iter_s: float, micro_batches: int, parts: Sequence[int],
            cpus: Optional[SharedCpus] = None) -> Plan:
    """What the run measured (`layers` cut at `current_parts`, `measured_iter_s` an iteration) predicts for the
    same layers cut at `parts` (any number of stages), by the model of the module docstring."""
    costs = [layer.seconds for layer in sorted(layers, key=lambda layer: layer.index)]
    parts = list(parts)
    if len(parts) < 2 or parts[0] != 0 or parts[-1] != len(costs) or any(a >= b for a, b in zip(parts, parts[1:])):
        raise ValueError(f"parts {list(parts)} do not cut {len(costs)} layers into non-empty stages")
    overheads = overheads_for(overhead_s, len(parts) - 1)
    unmodelled = measured_iter_s - model_iter_s(_loads(costs, list(current_parts), list(overhead_s)), micro_batches,
                                                 cpus)
    stage_s = _loads(costs, parts, overheads)
    predicted = model_iter_s(stage_s, micro_batches, cpus) + unmodelled
    bubble = 1 - sum(stage_s) / len(stage_s) / predicted if predicted > 0 else 0.0
    return Plan(parts, stage_s, max(stage_s), predicted, bubble)


def overheads_for(overhead_s: Sequence[float], stages: int) -> List[float]:
    """Each stage position's overhead for `stages` stages: as measured for as many stages as ran; for another
    number, the first's and the last's kept at the ends, none in between."""
    if stages == len(overhead_s):
        return list(overhead_s)
    if stages == 1:
        return [sum(overhead_s)]
    return [overhead_s[0]] + [0.0] * (stages - 2) + [overhead_s[-1]]


# ---------------------------------------------------------------- a report's plan
