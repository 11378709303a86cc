"""A saved report's plan: the partition its measured layers ask for (planner.py), under a memory limit where its
memory terms allow (memory_model.py), as the report's `partition_plan` and megatron-plan-partition print it, with each
stage's recompute chosen with it (report_recompute.py). The report read from its file: report_file.py.
"""
from dataclasses import dataclass
from typing import List, Optional

from patches.formats.units import bytes_to_string
from patches.partition.measured_run import Basis, MeasuredRun
from patches.partition.memory_model import RangeLargest, memory_terms_of, positions_for, stage_peak
from patches.partition.planner import DEVICE, LayerCost, PeakOf, plan, predict
from patches.partition.report_recompute import recompute_plan_of
from patches.partition.table import layer_seconds, shared_on_one_stage, stage_overheads
from patches.process.errors import PatchConfigError


def plan_parts_of(replica: List[dict]) -> Optional[List[int]]:
    """The partition that ran, as the replica's entries recorded it (PipelineModule.parts)."""
    return next((entry.get("parts") for entry in replica if entry.get("parts")), None)


@dataclass(frozen=True)
class PlanRequest:
    """What to ask of a measured run: the best partition into `stages` (default: as many as ran), every stage's
    predicted peak within `limit` bytes where one is given (limit_source: 'flag', 'environment' or 'device'); or,
    with `parts`, what those parts would do (a what-if of a partition the plan did not choose)."""
    stages: Optional[int] = None
    parts: Optional[List[int]] = None
    limit: Optional[int] = None
    limit_source: Optional[str] = None

    def planned_stages(self, run: MeasuredRun) -> int:
        return len(self.parts) - 1 if self.parts else self.stages or len(run.parts) - 1


def partition_plan(stages: List[dict], layers: Optional[List[dict]], parts: Optional[List[int]], iter_s: float,
                   micro_batches: int, basis: Optional[Basis] = None, limit: Optional[int] = None,
                   source: Optional[str] = None, schedule: Optional[str] = None) -> Optional[dict]:
    """The best contiguous partition of the measured layers over the stages that ran, and what it predicts
    (above), beside the partition that ran; None without a layer table (or with one stage). limit: each stage's
    memory peak at most this many bytes, where the stages and layers have their memory terms (source: where the
    limit came from, 'flag', 'environment' or 'device')."""
    if layers is None or parts is None or len(stages) != len(parts) - 1 or len(stages) < 2:
        return None
    run = MeasuredRun(layers, parts, stage_overheads(stages, layers), iter_s, micro_batches, basis or Basis(),
                      memory_terms_of({"stages": stages, "layers": layers}), schedule)
    return plan_from_table(run, PlanRequest(limit=limit, limit_source=source))


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
    ordered = sorted(layers, key=lambda layer: layer.index)
    for layer in ordered:
        state.append(state[-1] + layer.state_bytes)
        kept.append(kept[-1] + layer.activation_bytes)
    largest = RangeLargest([layer.largest_param_bytes for layer in ordered])

    def peak(stage: int, first: int, stop: int) -> int:
        position = chosen[stage]  # the largest parameter is read only where the optimizer's floor is set
        floor = largest.of(first, stop) if position.step_floor_param_bytes else 0
        return stage_peak(state[stop] - state[first], kept[stop] - kept[first], position,
                          largest_param_bytes=floor).predicted_peak_bytes

    return peak


def plan_from_table(run: MeasuredRun, request: PlanRequest) -> Optional[dict]:
    """partition_plan's dict for `request` from a run's layer table (also for a saved report, plan_of). The run's
    basis.time_scale scales every measured time (the layers' and the stages' overheads) to its steady iteration;
    the peaks are memory_model's; under a limit, recompute_plan is the partition with each stage's recompute chosen
    with it (not for a what-if)."""
    layers, parts, iter_s, micro_batches = run.layers, run.parts, run.iter_s, run.micro_batches
    pp = request.planned_stages(run)
    if len(layers) < pp or shared_on_one_stage(layers):
        return None
    scaled_overheads = run.scaled_overheads
    costs = [LayerCost(row["index"], row["type"], row["stage"], layer_seconds(row) * run.stage_scale(row["stage"]))
             for row in layers]
    current = run.ran_stage_s
    peak = peak_of(run.memory, pp, micro_batches, run.schedule)
    limit, source = request.limit, request.limit_source
    if peak is None and source == DEVICE:  # the device's memory is a default, not asked for: planned by time
        limit = source = None
    cpus = run.shared_cpus
    best = predict(costs, parts, scaled_overheads, iter_s, micro_batches, request.parts, cpus) if request.parts \
        else plan(costs, parts, scaled_overheads, iter_s, micro_batches, pp, peak, limit, cpus)
    peaks = [peak(s, best.parts[s], best.parts[s + 1]) for s in range(pp)] if peak is not None else None
    fits = max(peaks) <= limit if peaks is not None and limit is not None else None
    change = best.predicted_iter_s / iter_s - 1
    recompute = None if request.parts else recompute_plan_of(run, pp, limit)
    return {"pipeline_parallel_size": pp, "current_parts": list(parts), "current_stage_s": current,
            "current_bound_s": max(current), "current_bounding_stage": current.index(max(current)),
            "measured_iter_s": iter_s, "stage_overhead_s": run.overheads, "parts": best.parts,
            "stage_s": best.stage_s, "bound_s": best.bound_s, "predicted_iter_s": best.predicted_iter_s,
            "predicted_change": change, "predicted_bubble": best.predicted_bubble,
            "basis": run.basis.as_dict() if run.basis is not None else None,
            "gain_within_spread": gain_within_spread(change, best.parts != list(parts), run.basis),
            "memory_limit_bytes": limit, "memory_limit_source": source if limit is not None else None,
            "predicted_peak_bytes": peaks, "memory_fits": fits,
            "memory_excess_bytes": max(peaks) - limit if fits is False else None, "recompute_plan": recompute}


def gain_within_spread(change: float, moved: bool, basis: Optional[Basis]) -> Optional[bool]:
    """Whether a plan's predicted gain is no larger than the spread of the steady iterations its times rest on (the
    measurements cannot tell such a gain from their own variation); None where nothing moves, the plan is slower, or
    no spread was measured."""
    if not moved or change >= 0 or basis is None or basis.spread is None or basis.note is not None:
        return None  # nothing moves, a slower plan (no gain to doubt: one a memory limit forces), or no spread
    return -change <= basis.spread


def plan_of(report: dict, request: PlanRequest = PlanRequest()) -> dict:
    """The report's partition plan for `request`, as report.partition_plan has it (plan_from_table). A limit that
    the report's memory terms cannot honour is a PatchConfigError, unless it is the device's (a default: planned by
    time)."""
    shared = shared_on_one_stage(report["layers"])
    if shared:
        raise PatchConfigError(
            f"layers {' and '.join(str(i) for i in shared[0])} of the profile report ran one tied module on one "
            "stage: their times cannot be told apart, so no plan is made from it (profile a partition that puts "
            "them on different stages)")
    run = MeasuredRun.of_report(report)
    limit, asked = request.limit, request.limit is not None and request.limit_source != DEVICE
    if asked and run.memory is None:
        raise PatchConfigError(
            f"a memory limit of {bytes_to_string(limit)} cannot be honoured: the profile report has no memory terms "
            "(each stage's memory and each layer's state and activation bytes, measured by this profiler on a "
            "pipeline run)")
    planned = request.planned_stages(run)
    if asked and peak_of(run.memory, planned, run.micro_batches, run.schedule) is None:
        raise PatchConfigError(
            f"a memory limit of {bytes_to_string(limit)} cannot be honoured for {planned} stages: the run's schedule "
            f"({run.schedule}) keeps micro-batches in flight in a way not known for them (plan for "
            f"{len(run.parts) - 1})")
    return plan_from_table(run, request)
