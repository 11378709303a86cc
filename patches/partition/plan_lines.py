"""A plan in words: the `partition:` line under the report's layer table and megatron-plan-partition's, what its
times rest on, and where memory does not fit."""
from typing import List, Optional

from patches.formats.units import bytes_to_string, duration_to_string
from patches.partition.table import shared_on_one_stage


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


def under_the_layer_table(layers: List[dict], plan: Optional[dict]) -> List[str]:
    """The lines under the report's layer table: the layers that ran one tied module on one stage (no partition
    is planned from their split time), then the plan's `partition:` line where the report has a plan."""
    lines = [f"  layers {' and '.join(str(i) for i in indices)} ran one tied module on one stage: its time and "
             "FLOPs are split evenly between them here, and no partition is planned from them"
             for indices in shared_on_one_stage(layers)]
    return lines + (["  " + plan_line(plan)] if plan else [])


def plan_line(plan: dict) -> str:
    """'stage 1 bounds at 211 ms with parts [0, 4, 7]; with parts [0, 5, 7] the bound is ...' (the printer's line
    under the layer table, and megatron-plan-partition's), then what its times rest on; under a memory limit, the
    stage with the least headroom, or, where no partition fits, by how much the closest exceeds (no_fit_line)."""
    current = _as_ran(plan)
    if plan.get("memory_fits") is False:
        return f"partition: {current}; {no_fit_line(plan)}" + recompute_words(plan)
    if plan["parts"] == plan["current_parts"]:
        within = " within the memory limit" if plan.get("memory_limit_bytes") is not None else ""
        return (f"partition: {current}, already the best contiguous one for these layers' measured times{within}"
                + memory_note(plan) + recompute_words(plan))
    return (f"partition: {current}; with parts {plan['parts']} (pp {plan['pipeline_parallel_size']}) the bound is "
            f"{duration_to_string(plan['bound_s'])}, iteration {duration_to_string(plan['predicted_iter_s'])} "
            f"predicted against {duration_to_string(plan['measured_iter_s'])} measured, "
            f"{100 * plan['predicted_change']:+.1f}%{basis_words(plan.get('basis'))}{spread_words(plan)}"
            + memory_note(plan) + recompute_words(plan))


def recompute_words(plan: dict) -> str:
    """'' without a recompute plan; else the fastest partition with each stage's recompute chosen with it, and
    its prediction: '; with each stage's recompute chosen too: parts [0, 4, 8], --pp-recompute-layers 1,0, ...'."""
    chosen = plan.get("recompute_plan")
    if not chosen:
        return ""
    counts = ",".join(map(str, chosen["recompute_layers"]))
    peaks = chosen["predicted_peak_bytes"]
    memory = (f"every stage within the limit, stage {peaks.index(max(peaks))} the closest at "
              f"{bytes_to_string(max(peaks))}" if chosen["memory_fits"] else
              f"none fits even recomputing every layer: the closest exceeds the limit by "
              f"{bytes_to_string(chosen['memory_excess_bytes'])}")
    return (f"; with each stage's recompute chosen too: parts {chosen['parts']}, --pp-recompute-layers {counts}, "
            f"iteration {duration_to_string(chosen['predicted_iter_s'])} predicted, "
            f"{100 * chosen['predicted_change']:+.1f}%, {memory}" + priced_from_forward_words(chosen))


def priced_from_forward_words(chosen: dict) -> str:
    """'' where every layer the choice recomputes recomputed in the run; else that their recompute is priced at
    their forward kept whole, which the run measured, and how to measure it instead."""
    layers = chosen.get("recompute_priced_from_forward")
    if not layers:
        return ""
    names = f"layer {layers[0]}" if len(layers) == 1 else \
        f"layers {', '.join(map(str, layers[:-1]))} and {layers[-1]}"
    return (f"; {names} kept {'its' if len(layers) == 1 else 'their'} activations whole in this run: "
            f"{'its' if len(layers) == 1 else 'their'} recompute is priced at that forward, not measured "
            "(a profile of a run that recomputes them measures it)")


def basis_words(basis: Optional[dict]) -> str:
    """'' for a plan without a basis (a report from before it); else how sure its times are, in a few words."""
    if not basis:
        return ""
    cpus = _shared_cpus_words(basis.get("shared_cpus"))
    if basis.get("note"):
        return f" (unsure: {basis['note']}{cpus})"
    iterations = basis["iterations"]
    spread = f", spread {100 * basis['spread']:.1f}%" if basis.get("spread") is not None else ""
    return f" (over iterations {', '.join(map(str, iterations))}{spread}{cpus})"


def _shared_cpus_words(shared: Optional[dict]) -> str:
    return f"; {shared_cpus_sentence(shared)}" if shared else ""


def shared_cpus_sentence(shared: dict) -> str:
    """Where the run's ranks shared too few CPUs (planner.SharedCpus as a dict): how much they waited, and how every
    prediction takes it (the plan's line says it, and the page's what-if)."""
    threads = f"{shared['threads']} thread{'s' if shared['threads'] > 1 else ''}"
    together = shared.get("together_rate")
    if together is not None and together < 1.0:  # CPUs that slow each other (profiler/host_contention.py)
        return (f"{shared['ranks']} ranks of {threads} on {shared['cpus']} CPUs did {100 * shared['share']:.0f}% "
                f"of their compute time's work at full speed: each ran {together:.2f}x its speed alone while all "
                "computed (measured), so stages busy at once slow each other: predicted as the schedule runs on "
                "those CPUs")
    return (f"{shared['ranks']} ranks of {threads} on {shared['cpus']} CPUs ran {100 * shared['share']:.0f}% of "
            "their compute time, waiting for a core the rest: predicted as the schedule runs on those CPUs")


def spread_words(plan: dict) -> str:
    """'' unless the predicted gain is within the spread of the iterations the plan rests on; then that these
    measurements cannot support acting on it."""
    if not plan.get("gain_within_spread"):
        return ""
    return "; the gain is within that spread, so these measurements cannot tell it from noise"


def what_if_line(plan: dict) -> str:
    """A what-if plan (PlanRequest(parts=...)) as one line: 'stage 1 bounds at 211 ms with parts [0, 4, 7]; with
    parts [0, 2, 7] (pp 2) stage 0 bounds at ...' (megatron-plan-partition --parts: a partition the user names, which
    may be worse);
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


def recompute_what_if_line(what_if: dict, measured_iter_s: float, limit: Optional[int]) -> str:
    """recompute_what_if's dict as one line: 'recompute: with parts [0, 3, 7] and --pp-recompute-layers 1,0,
    iteration ... predicted against ... measured, -9.0%; ...' (megatron-plan-partition --recompute)."""
    counts = ",".join(map(str, what_if["recompute_layers"]))
    peaks = what_if["predicted_peak_bytes"]
    worst = peaks.index(max(peaks))
    memory = "" if limit is None else (
        f"; every stage within {bytes_to_string(limit)}, stage {worst} the closest at {bytes_to_string(peaks[worst])}"
        if what_if["memory_fits"] else
        f"; stage {worst}'s predicted memory peak, {bytes_to_string(peaks[worst])}, exceeds {bytes_to_string(limit)} "
        f"by {what_if['memory_excess_bytes']:,} bytes")
    return (f"recompute: with parts {what_if['parts']} and --pp-recompute-layers {counts}, iteration "
            f"{duration_to_string(what_if['predicted_iter_s'])} predicted against "
            f"{duration_to_string(measured_iter_s)} measured, {100 * what_if['predicted_change']:+.1f}%" + memory
            + priced_from_forward_words(what_if))
