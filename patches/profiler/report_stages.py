"""Each stage of the report from its ranks' entries: the instructions merged over tensor ranks, the stage's
times (forward, backward, step, communication, the rest), and the bubble against the schedule's ideal (report.py
composes the report from them)."""
from typing import Dict, Iterable, List, Optional, Tuple

from patches.profiler.instructions import (
    BACKWARD_INSTRUCTIONS,
    COMM_INSTRUCTIONS,
    FORWARD_INSTRUCTIONS,
    INSTRUCTION_ORDER,
    REDUCE_INSTRUCTIONS,
    schedule_bubble,
)
from patches.profiler.tree_merge import clean_node, merge_tp_trees


def merge_instructions(per_rank: List[dict]) -> dict:
    names = {name for instructions in per_rank for name in instructions}
    known = [name for name in INSTRUCTION_ORDER if name in names]
    ordered = known + sorted(names - set(known))
    merged = {}
    for name in ordered:
        present = [instructions[name] for instructions in per_rank if name in instructions]
        merged[name] = {"count": max(int(i["count"]) for i in present),
                        "total_s": max(float(i["total_s"]) for i in present)}
    return merged


def instruction_s(instructions: dict, names: Iterable[str]) -> float:
    return sum(instructions[name]["total_s"] for name in names if name in instructions)


def schedule_span(entries: List[dict]) -> Optional[Tuple[float, float]]:
    """(span, clock error): the seconds from stage 0's first instruction start (the pipeline can do
    nothing before it; a later stage that entered train_batch earlier only waits for it) to the last
    backward instruction's end over `entries`, each rank's perf_counter moved onto rank 0's clock; and the
    largest clock error. None without events."""
    if not entries or any("events" not in e for e in entries):
        return None
    starts, ends = [], []
    for e in entries:
        offset = e["clock_offset_s"]
        if e["stage_id"] == 0:
            starts += [start - offset for _, _, start, _ in e["events"]]
        ends += [end - offset for name, _, _, end in e["events"] if name in BACKWARD_INSTRUCTIONS]
    if not starts or not ends:
        return None
    return max(ends) - min(starts), max(e["clock_error_s"] for e in entries)


def bubble_analysis(stages: List[dict], compute_s: Dict[int, float], bounding: dict, micro_batches: int,
                    span: Tuple[float, float], schedule: Optional[str] = None) -> dict:
    """Each stage's idle fraction over the schedule span against the schedule's ideal bubble (instructions.py;
    null where the profiler does not know the schedule).

    compute_s: {stage id: forward and backward instruction seconds of its busiest tp rank} (one rank's sum,
    which fits in the span, where the stage's fwd and bwd maxima may come from two ranks).
    schedule: the schedule's class (None: a plain engine, or DeepSpeed's 1F1B TrainSchedule order).
    """
    span_s, clock_error_s = span
    pp = len(stages)
    known = schedule_bubble(schedule)
    ideal = known.fraction(pp, micro_batches) if known is not None else None
    rows = []
    for stage in stages:
        idle_s = max(0.0, span_s - compute_s[stage["stage_id"]])
        rows.append({
            "stage_id": stage["stage_id"],
            "compute_s": compute_s[stage["stage_id"]],
            "idle_s": idle_s,
            "idle_fraction": idle_s / span_s,
            "over_ideal": idle_s / span_s - ideal if ideal is not None else None,
            "wait_for_bounding_s": bounding["busy_s"] - stage["busy_s"],
        })
    return {"schedule": schedule, "ideal_name": known.name if known else None,
            "ideal_formula": known.formula if known else None, "ideal_fraction": ideal,
            "schedule_span_s": span_s, "clock_error_s": clock_error_s, "bounding_stage": bounding["stage_id"],
            "stages": rows}


def build_stage(stage_id: int, entries: List[dict], train_batch_max_dp_s: float) -> dict:
    trees = [clean_node(e["modules"]) for e in entries]
    modules = merge_tp_trees(trees)
    instructions = merge_instructions([e["instructions"] for e in entries])
    train_batch_s = max(float(e["train_batch_latency_s"]) for e in entries)
    memory = [int(e["peak_memory_bytes"]) for e in entries if e.get("peak_memory_bytes") is not None]
    fwd_s = instruction_s(instructions, FORWARD_INSTRUCTIONS)
    bwd_s = instruction_s(instructions, BACKWARD_INSTRUCTIONS)
    step_s = instruction_s(instructions, ("OptimizerStep",))
    covered_s = instruction_s(instructions, instructions)
    return {
        "stage_id": stage_id,
        "global_ranks": sorted(int(e["global_rank"]) for e in entries),
        "params": modules["params"],
        "params_per_gpu": max(t["params"] for t in trees),
        "fwd_flops": modules["fwd_flops"],
        "bwd_flops": modules["bwd_flops"],
        "recompute_flops": modules["recompute_flops"],
        "fwd_latency_s": fwd_s,
        "bwd_latency_s": bwd_s,
        "step_latency_s": step_s,
        "train_batch_latency_s": train_batch_s,
        "train_batch_latency_max_dp_s": train_batch_max_dp_s,
        "comm_s": instruction_s(instructions, COMM_INSTRUCTIONS),
        "reduce_s": instruction_s(instructions, REDUCE_INSTRUCTIONS),
        "load_s": instruction_s(instructions, ("LoadMicroBatch",)),
        "instructions_s": covered_s,
        "other_s": max(0.0, train_batch_s - covered_s),
        "busy_s": fwd_s + bwd_s + step_s,
        "peak_memory_bytes": max(memory) if memory else None,
        "gc": max((e["gc"] for e in entries if e.get("gc")), key=lambda gc: gc["pause_s"], default=None),
        "instructions": instructions,
        "modules": modules,
    }
