"""What the reported replica's entries say as a whole: what its ranks could not measure, which iteration its
FLOPs were counted in, the schedule it ran, the attention no kernel showed, the ops without a formula."""
from typing import List, Optional


def measurement_faults(replica: List[dict]) -> List[dict]:
    """What the reported ranks could not measure, and why (fail_safe.py), in rank order; [] where all was."""
    return [dict(fault, global_rank=int(entry["global_rank"]), stage_id=int(entry["stage_id"]),
                 tp_rank=int(entry["tp_rank"]))
            for entry in sorted(replica, key=lambda e: e["global_rank"]) for fault in entry.get("faults") or ()]


def schedule_of(replica: List[dict]) -> Optional[str]:
    """The pipeline schedule's class the replica's ranks ran (the first that says)."""
    return next((entry.get("schedule") for entry in replica if entry.get("schedule")), None)


def flops_counting(replica: List[dict], step: int, counting_note: Optional[str] = None) -> dict:
    """Which iteration's ops the FLOPs were counted in, and whether the profiled one ran the same module calls.
    counting_note: why they were counted in the profiled iteration itself, where the run asked otherwise."""
    counted = {entry.get("counted_iteration") for entry in replica}
    differ = [f"rank {entry['global_rank']}: {call}" for entry in replica for call in entry.get("calls_differ") or ()]
    if counted == {None}:
        why = f" ({counting_note})" if counting_note else ""
        return {"counted_iteration": step, "calls_differ": [],
                "note": f"counted in iteration {step} itself, by a dispatch mode on its timed path{why}"}
    if len(counted) > 1:  # e.g. user code profiled the batch before on some ranks: they counted in the step
        where = {}
        for entry in replica:
            where.setdefault(entry.get("counted_iteration") or step, []).append(entry["global_rank"])
        parts = [f"in iteration {iteration} on ranks {sorted(ranks)}" for iteration, ranks in sorted(where.items())]
        return {"counted_iteration": None, "calls_differ": differ,
                "note": f"counted by a dispatch mode {'; '.join(parts)} (the ranks differ: each stage's FLOPs "
                        "are those of the iteration its ranks counted)"}
    (iteration,) = counted
    same = ("it ran the same module calls on inputs of the same shapes, phase by phase, on every rank"
            if not differ else
            f"its module calls or their input shapes differ from iteration {iteration}'s in {len(differ)} places "
            "(calls_differ): "
            f"the FLOPs are iteration {iteration}'s")
    return {"counted_iteration": iteration, "calls_differ": differ,
            "note": f"counted in iteration {iteration} by a dispatch mode, so that iteration {step} ran without "
                    f"one; {same}"}


def invisible_attention(replica: List[dict]) -> List[dict]:
    """The replica's attention modules that ran a kernel torch cannot see (ModuleProfiler.invisible_attention),
    once each (a stage's tp ranks name the same module), by module path."""
    found = {}
    for entry in replica:
        for module in entry.get("invisible_attention") or ():
            known = found.setdefault(module["module"], dict(module))
            known["calls"] = max(known["calls"], module["calls"])
    return [found[path] for path in sorted(found)]


def uncounted_ops(replica: List[dict]) -> List[dict]:
    """The replica's matrix-class ops without a formula, calls summed over its ranks, sorted by (op, phase)."""
    calls = {}
    for entry in replica:
        for op in entry.get("uncounted_ops", ()):
            key = (op["op"], op["phase"])
            calls[key] = calls.get(key, 0) + int(op["calls"])
    return [{"op": op, "phase": phase, "calls": n} for (op, phase), n in sorted(calls.items())]
