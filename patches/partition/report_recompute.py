"""A saved report's recompute, beside its partition plan (report_plan.py): each stage's recompute choices from its layer
table (each layer's seconds and bytes kept whole and as a checkpoint, from the run either way), the fastest partition
with each stage's recompute chosen with it under a limit (recompute_plan.py), and the what-if of a recompute choice
(megatron-plan-partition --parts ... --recompute ...)."""
from dataclasses import replace
from typing import List, Optional, Tuple

from patches.partition.measured_run import MeasuredRun
from patches.partition.memory_model import positions_for
from patches.partition.planner import model_iter_s, overheads_for
from patches.partition.recompute_plan import RecomputableLayer, StageChoice, StageOptions, plan_recompute
from patches.process.errors import PatchConfigError


def recomputable_rows(layers: List[dict]) -> List[bool]:
    """Which layers DeepSpeed would checkpoint (PipelineModule._is_checkpointable): a GPT's transformer layers, or,
    in a model without them, every layer with parameters; any layer that recomputed in the run."""
    gpt = any("TransformerLayer" in row["type"] for row in layers)
    return [bool(row["recompute_flops"]) or ("TransformerLayer" in row["type"] if gpt else row["params"] > 0)
            for row in layers]


def recompute_plan_of(run: MeasuredRun, pp: int, limit: Optional[int]) -> Optional[dict]:
    """The fastest partition of `pp` stages with each stage's recompute chosen with it under `limit`
    (recompute_plan.py), where the run has a limit, its memory terms and each layer's bytes both ways; None
    otherwise. Its iteration is predicted as the partition plan's (the model plus what it leaves out of the measured
    iteration)."""
    options = recompute_options(run, pp)
    if limit is None or options is None:
        return None
    chosen = plan_recompute(options.layers, options.positions, options.overheads, limit)
    return _recompute_dict(chosen.parts, chosen.stages, run, chosen.excess_bytes)


def recompute_what_if(report: dict, parts: List[int], counts: List[int], limit: Optional[int] = None) -> dict:
    """What the report's measured run predicts for its layers cut at `parts`, stage s recomputing its first
    counts[s] recomputable layers (megatron-plan-partition --parts ... --recompute ...): recompute_plan's dict;
    memory_fits against `limit` (None without one). PatchConfigError where the report cannot say (no memory terms or
    bytes both ways, another number of counts than stages)."""
    if len(counts) != len(parts) - 1:
        raise PatchConfigError(f"--recompute {','.join(map(str, counts))}: {len(counts)} counts for "
                               f"{len(parts) - 1} stages")
    run = MeasuredRun.of_report(report)
    options = recompute_options(run, len(parts) - 1)
    if options is None:
        raise PatchConfigError("the profile report has no bytes of its layers both ways (kept whole and as a "
                               "checkpoint) or no memory terms: a recompute cannot be predicted from it")
    stages = [options.choice(stage, first, stop, count)
              for stage, (first, stop, count) in enumerate(zip(parts, parts[1:], counts))]
    excess = max(stage.peak_bytes for stage in stages) - limit if limit is not None else None
    return _recompute_dict(parts, stages, run, excess if excess and excess > 0 else None)


def recompute_options(run: MeasuredRun, pp: int) -> Optional[StageOptions]:
    """Every stage's recompute choices for `pp` stages from the run's layer table and memory terms (each position
    told the largest layer the run recomputed there: its transient holds it already); None where the report lacks
    each layer's bytes both ways, or cannot say for `pp` stages."""
    layers = run.layers
    if run.memory is None or any(row.get("kept_as_checkpoint_bytes") is None for row in layers):
        return None
    ran = [replace(position, recomputed_transient_bytes=_run_recompute_rise(layers, stage))
           for stage, position in enumerate(run.memory[1])]
    try:
        positions = positions_for(ran, pp, run.micro_batches, run.schedule)
        positions[-1] = replace(positions[-1], holds_the_loss=True)
    except ValueError:
        return None
    rows = sorted(layers, key=lambda row: row["index"])
    table = [RecomputableLayer(row["index"],
                               *(seconds * run.stage_scale(row["stage"]) for seconds in _both_ways_s(row)),
                               recomputable, row["state_bytes"], row["kept_whole_bytes"],
                               row["kept_as_checkpoint_bytes"], row.get("largest_param_bytes") or 0)
             for row, recomputable in zip(rows, recomputable_rows(rows))]
    return StageOptions(table, positions, overheads_for(run.scaled_overheads, pp))


def _both_ways_s(row: dict) -> Tuple[float, float]:
    """(a layer's seconds kept whole, what recomputing it adds), from the run either way. A layer the run
    recomputed ran its forward inside DeepSpeed's checkpoint, without autograd, and again with autograd in its
    backward, the recompute: kept whole, its forward is one with autograd, which the recompute measured and which
    is never faster than the same forward without autograd, so the larger of the two; recomputing it adds the
    rest of what the run measured (the run's own total stays as measured). (In docs/benchmarks.md's recompute proof
    the recompute took 1.14x and 1.21x the checkpointed forward; pricing the forward kept whole at the checkpointed
    one predicted the plans from a recompute run up to 10% too fast.) A layer the run kept whole: its forward and
    backward, and recomputing it adds about one forward."""
    forward, backward = row["fwd_latency_s"], row["bwd_latency_s"]
    if row["recompute_flops"]:
        recompute = row["recompute_latency_s"]
        return max(forward, recompute) + backward, min(forward, recompute)
    return forward + backward, forward


def _run_recompute_rise(layers: List[dict], stage: int) -> int:
    """What the run's own recompute on `stage` added to its measured transient (StageOptions._rise, as it ran): the
    largest layer it recomputed there, kept whole, less what the layers after the last recomputed one kept."""
    held = [row for row in layers if row["stage"] == stage]
    recomputed = [row for row in held if row["recompute_flops"]]
    if not recomputed:
        return 0
    last = max(row["index"] for row in recomputed)
    freed = sum(row["kept_whole_bytes"] for row in held if row["index"] > last)
    return max(0, max(row["kept_whole_bytes"] for row in recomputed) - freed)


def _recompute_dict(parts: List[int], stages: List[StageChoice], run: MeasuredRun, excess: Optional[int]) -> dict:
    """recompute_plan's dict: its iteration predicted as the partition plan's (the model, plus what it leaves out of
    the measured iteration: that iteration minus the model of the stages as they ran)."""
    stage_s, cpus, micro_batches = [stage.seconds for stage in stages], run.shared_cpus, run.micro_batches
    predicted = model_iter_s(stage_s, micro_batches, cpus) + run.iter_s - run.ran_model_iter_s
    return {"parts": list(parts), "recompute_layers": [stage.recomputed for stage in stages], "stage_s": stage_s,
            "predicted_iter_s": predicted, "predicted_change": predicted / run.iter_s - 1,
            "predicted_peak_bytes": [stage.peak_bytes for stage in stages],
            "memory_fits": excess is None, "memory_excess_bytes": excess,
            "recompute_priced_from_forward": priced_from_forward(run.layers, stages)}


def priced_from_forward(layers: List[dict], stages: List[StageChoice]) -> List[int]:
    """The layers a plan recomputes that the run kept whole: their recompute is priced at their forward as the run
    kept it (_both_ways_s), not measured; a run that recomputes them measures it."""
    rows = sorted(layers, key=lambda row: row["index"])
    recomputable = [row["index"] for row, can in zip(rows, recomputable_rows(rows)) if can]
    ran = {row["index"] for row in rows if row["recompute_flops"]}
    chosen = [index for stage in stages
              for index in [i for i in recomputable if stage.first <= i < stage.stop][:stage.recomputed]]
    return [index for index in chosen if index not in ran]
