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
   ran, and is added unchanged: predicted = model(new) + (measured - model(current)).

Under a memory limit (a report with memory terms, memory_model.py), the partition is the best of those whose every
stage's predicted peak is within the limit (memory_bounded_parts): a stage's peak depends only on its layers and
its position, so each candidate stage is kept or refused on its own inside the same dynamic programme. Where no
partition fits, the plan is the one whose largest peak is the smallest (least_peak_parts), balanced among
those, with by how much it exceeds.

parse_size reads a memory size as a user writes it ('80GB', '1.5GiB'), for the per-stage memory limit.
"""
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, List, Optional, Sequence, Tuple

from patches.formats.units import bytes_to_string, duration_to_string
from patches.partition.memory_model import memory_terms_of, positions_for, stage_peak
from patches.partition.table import layer_seconds, shared_on_one_stage, stage_overheads
from patches.process.errors import PatchConfigError

DEVICE = "device"  # a limit's source: the accelerator's total memory (the others: 'flag', 'environment')
# peak(stage, first, stop): the predicted memory peak of stage `stage` holding layers first .. stop - 1
PeakOf = Callable[[int, int, int], int]


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


def balanced_parts(costs: Sequence[float], stages: int, overheads: Optional[Sequence[float]] = None,
                   fits: Optional[Callable[[int, int, int], bool]] = None) -> Optional[List[int]]:
    """The contiguous partition of `costs` into `stages` non-empty parts whose loads (a part's costs plus its
    position's overhead), sorted from the largest, are lexicographically smallest: the largest load as small as
    it can be, then the second largest, and so on; ties broken by the earliest boundaries.
    fits(stage, first, stop): whether that stage may hold costs first .. stop - 1 (None: any); with it, the best
    of the partitions whose every stage fits, or None where none does."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    overheads = list(overheads) if overheads is not None else [0.0] * stages
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[k][i]: (the sorted-descending loads, the boundaries) of the first i layers cut into k stages
    best: List[List[Optional[Tuple[tuple, tuple]]]] = [[None] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = ((), (0,))
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] is None or (fits is not None and not fits(k - 1, j, i)):
                    continue
                loads, bounds = best[k - 1][j]
                load = prefix[i] - prefix[j] + overheads[k - 1]
                candidate = (tuple(sorted(loads + (load,), reverse=True)), bounds + (i,))
                if best[k][i] is None or candidate < best[k][i]:
                    best[k][i] = candidate
    return list(best[stages][n][1]) if best[stages][n] is not None else None


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


def model_iter_s(stage_s: Sequence[float], micro_batches: int) -> float:
    """DeepSpeed's 1F1B: one micro-batch through every stage, the other m - 1 at the slowest stage's pace."""
    per_micro_batch = [seconds / micro_batches for seconds in stage_s]
    return sum(per_micro_batch) + (micro_batches - 1) * max(per_micro_batch)


def plan(layers: Sequence[LayerCost], current_parts: Sequence[int], overhead_s: Sequence[float],
         measured_iter_s: float, micro_batches: int, stages: Optional[int] = None, peak: Optional[PeakOf] = None,
         limit: Optional[int] = None) -> Plan:
    """The best contiguous partition of `layers` (in index order) into `stages` (default: as many as ran), and the
    iteration time it predicts (see the module docstring). overhead_s: each stage position's compute that no
    layer accounts for, as measured (for another number of stages, see _overheads_for). peak and limit: the best
    of those whose every stage's peak is within the limit (memory_bounded_parts)."""
    costs = [layer.seconds for layer in sorted(layers, key=lambda layer: layer.index)]
    stages = stages or len(current_parts) - 1
    overheads = _overheads_for(overhead_s, stages)
    if peak is not None and limit is not None:
        parts, _ = memory_bounded_parts(costs, stages, overheads, peak, limit)
    else:
        parts = balanced_parts(costs, stages, overheads)
    return predict(layers, current_parts, overhead_s, measured_iter_s, micro_batches, parts)


def predict(layers: Sequence[LayerCost], current_parts: Sequence[int], overhead_s: Sequence[float],
            measured_iter_s: float, micro_batches: int, parts: Sequence[int]) -> Plan:
    """What the run measured (`layers` cut at `current_parts`, `measured_iter_s` an iteration) predicts for the
    same layers cut at `parts` (any number of stages), by the model of the module docstring."""
    costs = [layer.seconds for layer in sorted(layers, key=lambda layer: layer.index)]
    parts = list(parts)
    if len(parts) < 2 or parts[0] != 0 or parts[-1] != len(costs) or any(a >= b for a, b in zip(parts, parts[1:])):
        raise ValueError(f"parts {list(parts)} do not cut {len(costs)} layers into non-empty stages")
    overheads = _overheads_for(overhead_s, len(parts) - 1)
    unmodelled = measured_iter_s - model_iter_s(_loads(costs, list(current_parts), list(overhead_s)), micro_batches)
    stage_s = _loads(costs, parts, overheads)
    predicted = model_iter_s(stage_s, micro_batches) + unmodelled
    bubble = 1 - sum(stage_s) / len(stage_s) / predicted if predicted > 0 else 0.0
    return Plan(parts, stage_s, max(stage_s), predicted, bubble)


def _overheads_for(overhead_s: Sequence[float], stages: int) -> List[float]:
    """Each stage position's overhead for `stages` stages: as measured for as many stages as ran; for another
    number, the first's and the last's kept at the ends, none in between."""
    if stages == len(overhead_s):
        return list(overhead_s)
    if stages == 1:
        return [sum(overhead_s)]
    return [overhead_s[0]] + [0.0] * (stages - 2) + [overhead_s[-1]]


# ---------------------------------------------------------------- a report's plan
def plan_parts_of(replica: List[dict]) -> Optional[List[int]]:
    """The partition that ran, as the replica's entries recorded it (PipelineModule.parts)."""
    return next((entry.get("parts") for entry in replica if entry.get("parts")), None)


@dataclass(frozen=True)
class Basis:
    """What a plan's times rest on: the steady iteration they are scaled to, and how steady it was."""
    time_scale: float = 1.0  # the measured layer times x this: unprofiled / profiled iteration, on one clock
    iterations: Tuple[int, ...] = ()  # the unprofiled iterations the iteration time is the median of
    spread: Optional[float] = None  # (slowest - fastest) / median of those
    note: Optional[str] = None  # why the basis is weak (a warm-up baseline, none), or None

    def as_dict(self) -> dict:
        return {"time_scale": self.time_scale, "iterations": list(self.iterations), "spread": self.spread,
                "note": self.note}


def partition_plan(stages: List[dict], layers: Optional[List[dict]], parts: Optional[List[int]], iter_s: float,
                   micro_batches: int, basis: Basis = Basis(), limit: Optional[int] = None,
                   source: Optional[str] = None, schedule: Optional[str] = None) -> Optional[dict]:
    """The best contiguous partition of the measured layers over the stages that ran, and what it predicts
    (above), beside the partition that ran; None without a layer table (or with one stage). limit: each stage's
    memory peak at most this many bytes, where the stages and layers have their memory terms (source: where the
    limit came from, 'flag', 'environment' or 'device')."""
    if layers is None or parts is None or len(stages) != len(parts) - 1 or len(stages) < 2:
        return None
    return plan_from_table(layers, parts, stage_overheads(stages, layers), iter_s, micro_batches, basis=basis,
                           memory=memory_terms_of({"stages": stages, "layers": layers}), limit=limit, source=source,
                           schedule=schedule)


def peak_of(memory, stages: int, micro_batches: int, schedule: Optional[str]) -> Optional[PeakOf]:
    """peak(stage, first, stop) for `stages` stages from memory_model's (layers, positions) terms; None where the
    terms are missing or cannot say (another number of stages under another schedule than 1F1B)."""
    if memory is None:
        return None
    layers, positions = memory
    try:
        chosen = positions_for(positions, stages, micro_batches, schedule)
    except ValueError:
        return None
    state, kept = [0], [0]
    for layer in sorted(layers, key=lambda layer: layer.index):
        state.append(state[-1] + layer.state_bytes)
        kept.append(kept[-1] + layer.activation_bytes)

    def peak(stage: int, first: int, stop: int) -> int:
        return stage_peak(state[stop] - state[first], kept[stop] - kept[first], chosen[stage]).predicted_peak_bytes

    return peak


def plan_from_table(layers: List[dict], parts: List[int], overheads: List[float], iter_s: float,
                    micro_batches: int, pp: Optional[int] = None, cut_at: Optional[List[int]] = None,
                    basis: Optional[Basis] = None, memory=None, limit: Optional[int] = None,
                    source: Optional[str] = None, schedule: Optional[str] = None) -> Optional[dict]:
    """partition_plan's dict from a report's layer table (also for a saved report, cli/plan_partition.py).
    cut_at: the prediction for these parts instead of the best ones. basis.time_scale scales every measured
    time (the layers' and the stages' overheads, `overheads` as measured) to the steady iteration `iter_s`.
    memory: memory_model.memory_terms_of's (layers, positions), for each stage's predicted peak; limit: the best
    parts under it, by the same scaled times (source: where it came from); schedule: the run's, for the in-flight
    micro-batches of another number of stages."""
    ran = len(parts) - 1
    pp = len(cut_at) - 1 if cut_at else pp or ran
    if len(layers) < pp or shared_on_one_stage(layers):
        return None
    scale = basis.time_scale if basis is not None else 1.0
    costs = [LayerCost(row["index"], row["type"], row["stage"], layer_seconds(row) * scale) for row in layers]
    scaled_overheads = [overhead * scale for overhead in overheads]
    current = [sum(cost.seconds for cost in costs if cost.stage == s) + scaled_overheads[s] for s in range(ran)]
    peak = peak_of(memory, pp, micro_batches, schedule)
    if peak is None and source == DEVICE:  # the device's memory is a default, not asked for: planned by time
        limit = source = None
    best = predict(costs, parts, scaled_overheads, iter_s, micro_batches, cut_at) if cut_at else \
        plan(costs, parts, scaled_overheads, iter_s, micro_batches, pp, peak, limit)
    peaks = [peak(s, best.parts[s], best.parts[s + 1]) for s in range(pp)] if peak is not None else None
    fits = max(peaks) <= limit if peaks is not None and limit is not None else None
    change = best.predicted_iter_s / iter_s - 1
    return {"pipeline_parallel_size": pp, "current_parts": list(parts), "current_stage_s": current,
            "current_bound_s": max(current), "current_bounding_stage": current.index(max(current)),
            "measured_iter_s": iter_s, "stage_overhead_s": overheads, "parts": best.parts, "stage_s": best.stage_s,
            "bound_s": best.bound_s, "predicted_iter_s": best.predicted_iter_s,
            "predicted_change": change, "predicted_bubble": best.predicted_bubble,
            "basis": basis.as_dict() if basis is not None else None,
            "gain_within_spread": gain_within_spread(change, best.parts != list(parts), basis),
            "memory_limit_bytes": limit, "memory_limit_source": source if limit is not None else None,
            "predicted_peak_bytes": peaks, "memory_fits": fits,
            "memory_excess_bytes": max(peaks) - limit if fits is False else None}


def gain_within_spread(change: float, moved: bool, basis: Optional[Basis]) -> Optional[bool]:
    """Whether a plan's predicted gain is no larger than the spread of the steady iterations its times rest on (the
    measurements cannot tell such a gain from their own variation); None where nothing moves or no spread was
    measured."""
    if not moved or basis is None or basis.spread is None or basis.note is not None:
        return None
    return -change <= basis.spread


def plan_of(report: dict, stages: Optional[int] = None, cut_at: Optional[List[int]] = None,
            limit: Optional[int] = None, source: Optional[str] = None) -> dict:
    """The report's partition plan for `stages` (default: as many as ran), as report.partition_plan has it;
    cut_at: its prediction for these parts instead (a partition the plan did not choose). limit (bytes): plan
    with every stage's predicted peak within it (source: where it came from). A limit that the report's memory
    terms cannot honour is a PatchConfigError, unless it is the device's (a default: planned by time)."""
    plan = report.get("partition_plan") or {}
    parts = plan.get("current_parts") or _parts_from_layers(report["layers"])
    overheads = plan.get("stage_overhead_s") or [0.0] * (len(parts) - 1)
    iter_s = report["totals"]["throughput_iter_s"]
    shared = shared_on_one_stage(report["layers"])
    if shared:
        raise PatchConfigError(
            f"layers {' and '.join(str(i) for i in shared[0])} of the profile report ran one tied module on one "
            "stage: their times cannot be told apart, so no plan is made from it (profile a partition that puts "
            "them on different stages)")
    stored = plan.get("basis")  # None in a report from before plans had one
    basis = Basis(stored["time_scale"], tuple(stored["iterations"]), stored["spread"], stored["note"]) \
        if stored else None
    memory = memory_terms_of(report)
    micro_batches = report["parallelism"]["micro_batches"]
    schedule = (report.get("bubble") or {}).get("schedule")
    asked = limit is not None and source != DEVICE
    if asked and memory is None:
        raise PatchConfigError(
            f"a memory limit of {bytes_to_string(limit)} cannot be honoured: the profile report has no memory terms "
            "(each stage's memory and each layer's state and activation bytes, measured by this profiler on a "
            "pipeline run)")
    if asked and peak_of(memory, len(cut_at) - 1 if cut_at else stages or len(parts) - 1, micro_batches,
                         schedule) is None:
        planned = len(cut_at) - 1 if cut_at else stages
        raise PatchConfigError(
            f"a memory limit of {bytes_to_string(limit)} cannot be honoured for {planned} stages: the run's schedule "
            f"({schedule}) keeps micro-batches in flight in a way not known for them (plan for {len(parts) - 1})")
    return plan_from_table(report["layers"], parts, overheads, iter_s, micro_batches, stages, cut_at, basis, memory,
                           limit, source, schedule)


def _as_ran(plan: dict) -> str:
    return (f"stage {plan['current_bounding_stage']} bounds at {duration_to_string(plan['current_bound_s'])} "
            f"with parts {plan['current_parts']}")


def _limit(plan: dict) -> str:
    source = plan.get("memory_limit_source")
    return f"{bytes_to_string(plan['memory_limit_bytes'])}" + (f" ({source})" if source else "")


def memory_note(plan: dict) -> str:
    """What the plan says of memory, '' where it has no limit: the stage with the least headroom under the limit,
    or that the limit could not be read against (a report without memory terms)."""
    if plan.get("memory_limit_bytes") is None:
        return ""
    peaks = plan.get("predicted_peak_bytes")
    if peaks is None:
        return f"; the memory limit of {_limit(plan)} is not honoured: the report has no memory terms"
    tightest = peaks.index(max(peaks))
    return (f"; stage {tightest} has the least memory headroom, {bytes_to_string(peaks[tightest])} predicted of "
            f"{_limit(plan)}")


def no_fit_line(plan: dict) -> str:
    """A plan with memory_fits false, in one line: by how much the partition closest to the limit exceeds it."""
    peaks = plan["predicted_peak_bytes"]
    worst = peaks.index(max(peaks))
    return (f"no partition of these {plan['parts'][-1]} layers into "
            f"{plan['pipeline_parallel_size']} stages keeps every stage's predicted memory peak within "
            f"{_limit(plan)}: the closest, parts {plan['parts']}, exceeds it by {plan['memory_excess_bytes']:,} bytes "
            f"({bytes_to_string(plan['memory_excess_bytes'])}) on stage {worst}, "
            f"{bytes_to_string(peaks[worst])} predicted")


def plan_line(plan: dict) -> str:
    """'stage 1 bounds at 211 ms with parts [0, 4, 7]; with parts [0, 5, 7] the bound is ...' (the printer's line
    under the layer table, and megatron-plan-partition's), then what its times rest on; under a memory limit, the
    stage with the least headroom, or, where no partition fits, by how much the closest exceeds (no_fit_line)."""
    current = _as_ran(plan)
    if plan.get("memory_fits") is False:
        return f"partition: {current}; {no_fit_line(plan)}"
    if plan["parts"] == plan["current_parts"]:
        within = " within the memory limit" if plan.get("memory_limit_bytes") is not None else ""
        return (f"partition: {current}, already the best contiguous one for these layers' measured times{within}"
                + memory_note(plan))
    return (f"partition: {current}; with parts {plan['parts']} (pp {plan['pipeline_parallel_size']}) the bound is "
            f"{duration_to_string(plan['bound_s'])}, iteration {duration_to_string(plan['predicted_iter_s'])} "
            f"predicted against {duration_to_string(plan['measured_iter_s'])} measured, "
            f"{100 * plan['predicted_change']:+.1f}%{basis_words(plan.get('basis'))}{spread_words(plan)}"
            + memory_note(plan))


def basis_words(basis: Optional[dict]) -> str:
    """'' for a plan without a basis (a report from before it); else how sure its times are, in a few words."""
    if not basis:
        return ""
    if basis.get("note"):
        return f" (unsure: {basis['note']})"
    iterations = basis["iterations"]
    spread = f", spread {100 * basis['spread']:.1f}%" if basis.get("spread") is not None else ""
    return f" (over iterations {', '.join(map(str, iterations))}{spread})"


def spread_words(plan: dict) -> str:
    """'' unless the predicted gain is within the spread of the iterations the plan rests on; then that these
    measurements cannot support acting on it."""
    if not plan.get("gain_within_spread"):
        return ""
    return "; the gain is within that spread, so these measurements cannot tell it from noise"


def what_if_line(plan: dict) -> str:
    """plan_of(..., cut_at=parts) as one line: 'stage 1 bounds at 211 ms with parts [0, 4, 7]; with parts [0, 2, 7]
    (pp 2) stage 0 bounds at ...' (megatron-plan-partition --parts: a partition the user names, which may be worse);
    under a memory limit, the stage with the least headroom or by how much the largest peak exceeds it."""
    bounding = plan["stage_s"].index(plan["bound_s"])
    line = (f"partition: {_as_ran(plan)}; with parts {plan['parts']} (pp {plan['pipeline_parallel_size']}) "
            f"stage {bounding} bounds at {duration_to_string(plan['bound_s'])}, iteration "
            f"{duration_to_string(plan['predicted_iter_s'])} predicted against "
            f"{duration_to_string(plan['measured_iter_s'])} measured, {100 * plan['predicted_change']:+.1f}%"
            f"{basis_words(plan.get('basis'))}")
    if plan.get("memory_fits") is False:
        peaks = plan["predicted_peak_bytes"]
        worst = peaks.index(max(peaks))
        return (line + f"; stage {worst}'s predicted memory peak, {bytes_to_string(peaks[worst])}, exceeds "
                f"{_limit(plan)} by {plan['memory_excess_bytes']:,} bytes")
    return line + memory_note(plan)


def _parts_from_layers(layers):
    stages = max(row["stage"] for row in layers) + 1
    return [min(row["index"] for row in layers if row["stage"] == s) for s in range(stages)] + [len(layers)]


def read_report(path: str) -> dict:
    """The profiler's JSON at `path`, checked for what planning reads. PatchConfigError, one line, otherwise."""
    try:
        with open(path) as f:
            report = json.load(f)
    except OSError as error:
        raise PatchConfigError(f"the profile report {path} cannot be read: {error.strerror}") from None
    except ValueError as error:
        raise PatchConfigError(f"the profile report {path} is not the profiler's JSON: {error}") from None
    problem = _what_planning_lacks(report)
    if problem:
        raise PatchConfigError(f"the profile report {path} is not the profiler's JSON: {problem}")
    return report


_LAYER_FIELDS = {"index": int, "type": str, "stage": int, "fwd_latency_s": (int, float),
                 "bwd_latency_s": (int, float), "recompute_latency_s": (int, float)}


def _what_planning_lacks(report) -> Optional[str]:
    """What a report lacks of the fields planning reads (a missing layer table is the callers' to say)."""
    if not isinstance(report, dict):
        return f"a JSON {type(report).__name__}, not an object"
    for section, field, kind in (("totals", "throughput_iter_s", (int, float)),
                                 ("parallelism", "micro_batches", int)):
        value = report.get(section, {}).get(field) if isinstance(report.get(section), dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"no {section}.{field}"
    layers = report.get("layers")
    if layers is None:
        return None
    if not isinstance(layers, list):
        return "its layers are not a list"
    for position, row in enumerate(layers):
        for field, kind in _LAYER_FIELDS.items():
            if not isinstance(row, dict) or not isinstance(row.get(field), kind) or isinstance(row.get(field), bool):
                return f"layer {position} has no {field}"
    if sorted(row["index"] for row in layers) != list(range(len(layers))):
        return "its layers are not numbered 0 to n - 1"
    return None


# ---------------------------------------------------------------- sizes
_SIZE_UNITS = {"": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
               "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}
# ASCII only: an ignore-case [a-z] would also take the Kelvin sign for a K.
_SIZE = re.compile(r"\s*(-?)([0-9]+(?:\.[0-9]+)?) *([a-z]*)\s*", re.IGNORECASE | re.ASCII)
SIZE_FORMS = ("a positive number of bytes, or one with KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers "
              "of 1024), upper or lower case, e.g. 80GB or 1.5GiB")


def parse_size(text: str) -> int:
    """A size in bytes from '80GB' (80 * 1000**3), '1.5GiB' (1.5 * 1024**3), '512' (bytes): see SIZE_FORMS. A
    decimal is rounded down to a whole byte. ValueError, one line naming the accepted forms, for anything else,
    a negative size or one under a byte."""
    match = _SIZE.fullmatch(text)
    if match is None or match.group(3).lower() not in _SIZE_UNITS:
        raise ValueError(f"size {text!r} is not a size: give {SIZE_FORMS}")
    sign, number, unit = match.groups()
    if sign:
        raise ValueError(f"size {text!r} is negative: give {SIZE_FORMS}")
    # Fraction, not float: 2.01 * 1000 in floats is 2009.9999999999998, and '2.01KB' is 2010 bytes.
    size = int(Fraction(number) * _SIZE_UNITS[unit.lower()])
    if size == 0:
        raise ValueError(f"size {text!r} is {'zero' if Fraction(number) == 0 else 'under one byte'}: give {SIZE_FORMS}")
    return size
