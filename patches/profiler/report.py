"""Turn the gathered per-rank measurements into the profile report (schema_version 2).

The contract is flops-profile.schema.json (files.py loads and checks it). Beyond the schema the
report carries:
- top level: `perturbation` (null, or the profiled iteration's time against unprofiled ones of the
  same run, and the training log line's TFLOPs), `optimizer_step_skipped` (fp16 loss
  scaling skipped the profiled step's update), `recompute_note`
  (null, or one line: the pipeline recomputes fewer layers than asked, which and why),
  `uncounted_ops` (matrix-class ops without a formula: the flops leave them out), `invisible_attention`
  (attention modules that ran but in which no matrix work was seen: a kernel torch cannot see, such as an
  older flash-attn, its Triton version or DeepSpeed's builder kernels, so their attention FLOPs are left out),
  `model_tree` (every stage's module tree under one root), `bounding_stage`, `device`
  ({name, dtype, peak_tflops}), `bubble` (the pipeline bubble analysis, or null when the entries
  carry no schedule events: `schedule`, the schedule's class or null on a plain engine; `ideal_name`,
  `ideal_formula` and `ideal_fraction` of it, null for a schedule the profiler does not know, and then
  each stage's `over_ideal` null too), `stragglers` (stragglers.py: each stage's timings over the data-parallel
  replicas) and `notes` (notes.py: the formulas used; the printer's Notations block);
- per stage: params_per_gpu, train_batch_latency_max_dp_s (over all data-parallel replicas),
  comm_s, reduce_s, load_s, instructions_s, other_s, busy_s (fwd + bwd + step), busy_share,
  tflops_per_gpu (the stage's fwd + bwd + recompute flops / iter latency / tp);
- totals: analytic ({fwd,bwd,recompute}_flops or null), measured_over_analytic, tokens_per_s,
  peak_tflops, throughput_iter_s and throughput_basis (the iteration time the rates use: "unprofiled"
  where the context's timing has an unprofiled time, else "profiled");
- module nodes: replicated_params, {fwd,bwd,recompute}_other_flops (non-matrix work) and
  {fwd,bwd,recompute}_calls, always present.
"""
from typing import Dict, List, Optional, Tuple

from patches.partition.report_plan import Basis, partition_plan, plan_parts_of
from patches.partition.table import layer_table
from patches.profiler.context import IterationTiming, ReportContext
from patches.profiler.instructions import (
    BACKWARD_INSTRUCTIONS,
    COMM_INSTRUCTIONS,
    FORWARD_INSTRUCTIONS,
    INSTRUCTION_ORDER,
    REDUCE_INSTRUCTIONS,
    schedule_bubble,
)
from patches.profiler.memory_report import add_layer_memory, per_gpu
from patches.profiler.notes import NOTES
from patches.profiler.stragglers import RankSample, straggler_view
from patches.profiler.tree_merge import clean_node, merge_stage_trees, merge_tp_trees

SCHEMA_VERSION = 2


def _merge_instructions(per_rank):
    names = {name for instructions in per_rank for name in instructions}
    known = [name for name in INSTRUCTION_ORDER if name in names]
    ordered = known + sorted(names - set(known))
    merged = {}
    for name in ordered:
        present = [instructions[name] for instructions in per_rank if name in instructions]
        merged[name] = {"count": max(int(i["count"]) for i in present),
                        "total_s": max(float(i["total_s"]) for i in present)}
    return merged


def _instruction_s(instructions, names):
    return sum(instructions[name]["total_s"] for name in names if name in instructions)


def _schedule_span(entries):
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


def _build_stage(stage_id, entries, train_batch_max_dp_s):
    trees = [clean_node(e["modules"]) for e in entries]
    modules = merge_tp_trees(trees)
    instructions = _merge_instructions([e["instructions"] for e in entries])
    train_batch_s = max(float(e["train_batch_latency_s"]) for e in entries)
    memory = [int(e["peak_memory_bytes"]) for e in entries if e.get("peak_memory_bytes") is not None]
    fwd_s = _instruction_s(instructions, FORWARD_INSTRUCTIONS)
    bwd_s = _instruction_s(instructions, BACKWARD_INSTRUCTIONS)
    step_s = _instruction_s(instructions, ("OptimizerStep",))
    covered_s = _instruction_s(instructions, instructions)
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
        "comm_s": _instruction_s(instructions, COMM_INSTRUCTIONS),
        "reduce_s": _instruction_s(instructions, REDUCE_INSTRUCTIONS),
        "load_s": _instruction_s(instructions, ("LoadMicroBatch",)),
        "instructions_s": covered_s,
        "other_s": max(0.0, train_batch_s - covered_s),
        "busy_s": fwd_s + bwd_s + step_s,
        "peak_memory_bytes": max(memory) if memory else None,
        "gc": max((e["gc"] for e in entries if e.get("gc")), key=lambda gc: gc["pause_s"], default=None),
        "instructions": instructions,
        "modules": modules,
    }


def _check_grid(context):
    pp, tp, dp = context.pipeline_parallel_size, context.tensor_parallel_size, context.data_parallel_size
    if pp * tp * dp != context.world_size:
        raise ValueError(f"pp {pp} x tp {tp} x dp {dp} != world size {context.world_size}")
    return pp, tp, dp


def _check_layout(rank_entries, context):
    pp, tp, dp = _check_grid(context)
    ranks = sorted(e["global_rank"] for e in rank_entries)
    if ranks != list(range(context.world_size)):
        raise ValueError(f"need one entry from each of the {context.world_size} ranks, got ranks {ranks}")
    coords = sorted((e["stage_id"], e["tp_rank"], e["dp_rank"]) for e in rank_entries)
    expected = [(s, t, d) for s in range(pp) for t in range(tp) for d in range(dp)]
    if coords != expected:
        raise ValueError("the entries' (stage, tp rank, dp rank) do not cover the pp x tp x dp grid once each")


def _check_replica(replica_entries, samples, context):
    """The gathered form: replica 0's entries (one per stage and tp rank) and every rank's sample."""
    pp, tp, dp = _check_grid(context)
    coords = sorted((e["stage_id"], e["tp_rank"], e["dp_rank"]) for e in replica_entries)
    if coords != [(s, t, 0) for s in range(pp) for t in range(tp)]:
        raise ValueError("the entries' (stage, tp rank) do not cover replica 0's pp x tp grid once each")
    if sorted(s.global_rank for s in samples) != list(range(context.world_size)):
        raise ValueError(f"need one sample from each of the {context.world_size} ranks")
    coords = sorted((s.stage_id, s.tp_rank, s.dp_rank) for s in samples)
    if coords != [(s, t, d) for s in range(pp) for t in range(tp) for d in range(dp)]:
        raise ValueError("the samples' (stage, tp rank, dp rank) do not cover the pp x tp x dp grid once each")


def build_report(rank_entries: List[dict], context: ReportContext, samples: Optional[List[RankSample]] = None) -> dict:
    """The report dict (schema_version 2 plus documented extras) from the entries and the run's context.

    rank_entries: every rank's entry (samples None: the straggler scalars are read from them), or
    replica 0's entries only with `samples`, every rank's RankSample (what gather.py collects).
    Every rate is computed here, once: over the unprofiled iteration time where context.timing has one,
    else over the profiled iteration's (iter latency)."""
    if samples is None:
        _check_layout(rank_entries, context)
        samples = [RankSample.from_entry(e) for e in rank_entries]
        rank_entries = [e for e in rank_entries if e["dp_rank"] == 0]
    else:
        _check_replica(rank_entries, samples, context)
    pp, tp, dp = context.pipeline_parallel_size, context.tensor_parallel_size, context.data_parallel_size
    stages = []
    memory_from = {}  # stage id -> the entry its memory figures come from
    for stage_id in range(pp):
        replica = sorted((e for e in rank_entries if e["stage_id"] == stage_id), key=lambda e: e["tp_rank"])
        max_dp_s = max(s.train_batch_s for s in samples if s.stage_id == stage_id)
        stages.append(_build_stage(stage_id, replica, max_dp_s))
        memory = per_gpu(replica, int(context.step))
        stages[-1]["memory"] = memory[0] if memory is not None else None
        if memory is not None:
            memory_from[stage_id] = memory[1]
    replica = rank_entries
    span = _schedule_span(replica)
    compute_s = {stage_id: max(_instruction_s(e["instructions"], FORWARD_INSTRUCTIONS + BACKWARD_INSTRUCTIONS)
                               for e in replica if e["stage_id"] == stage_id) for stage_id in range(pp)}

    iter_s = max(s["train_batch_latency_s"] for s in stages)
    if iter_s <= 0:
        raise ValueError("every stage's train_batch time is 0: nothing was timed")
    timing = context.timing
    unprofiled_s = timing.unprofiled_iter_s if timing is not None else None
    rate_s = unprofiled_s if unprofiled_s else iter_s  # the iteration time every rate below is taken over
    for stage in stages:
        stage["busy_share"] = stage["busy_s"] / iter_s
        stage_flops = stage["fwd_flops"] + stage["bwd_flops"] + stage["recompute_flops"]
        stage["tflops_per_gpu"] = stage_flops / rate_s / tp / 1e12
    bounding = max(stages, key=lambda s: (s["busy_s"], -s["stage_id"]))
    layers = layer_table(stages, replica)
    paused_s = max((stage["gc"]["pause_s"] for stage in stages if stage["gc"]), default=0.0)
    add_layer_memory(layers, memory_from)

    fwd = sum(s["fwd_flops"] for s in stages)
    bwd = sum(s["bwd_flops"] for s in stages)
    recompute = sum(s["recompute_flops"] for s in stages)
    measured = fwd + bwd + recompute
    model_tree = merge_stage_trees([s["modules"] for s in stages])
    samples_per_s = context.micro_batches * context.micro_batch_size * dp / rate_s
    seq = context.run.seq_length
    model_tflops = (fwd + bwd) / rate_s / (pp * tp) / 1e12
    tflops = measured / rate_s / (pp * tp) / 1e12
    peak = context.peak_tflops
    analytic = context.run.analytic
    analytic_flops = None
    if analytic is not None:
        analytic = {kind: int(analytic[kind]) for kind in ("fwd_flops", "bwd_flops", "recompute_flops")}
        analytic_flops = sum(analytic.values())

    totals = {
        "params": model_tree["params"],
        "fwd_flops": fwd,
        "bwd_flops": bwd,
        "recompute_flops": recompute,
        "analytic_flops": analytic_flops,
        "analytic": analytic,
        "measured_over_analytic": measured / analytic_flops if analytic_flops else None,
        "iter_latency_s": iter_s,
        "throughput_iter_s": rate_s,
        "throughput_basis": "unprofiled" if unprofiled_s else "profiled",
        "fwd_latency_s": bounding["fwd_latency_s"],
        "bwd_latency_s": bounding["bwd_latency_s"],
        "step_latency_s": bounding["step_latency_s"],
        "tflops_per_gpu": tflops,
        "model_tflops_per_gpu": model_tflops,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * seq if seq else None,
        "peak_tflops": peak,
        "mfu": model_tflops / peak if peak else None,
    }
    notes = dict(NOTES)
    if context.clock_note is not None:  # no ping rounds ran: the note says how the clocks were placed
        notes["clock_sync"] = context.clock_note
    return {
        "schema_version": SCHEMA_VERSION,
        "step": int(context.step),
        "parallelism": {
            "world_size": int(context.world_size),
            "pipeline_parallel_size": int(pp),
            "tensor_parallel_size": int(tp),
            "data_parallel_size": int(dp),
            "micro_batches": int(context.micro_batches),
            "micro_batch_size": int(context.micro_batch_size),
            "seq_length": seq,
        },
        "activation_checkpointing": bool(context.activation_checkpointing),
        "optimizer_step_skipped": bool(context.optimizer_step_skipped),
        "recompute_note": context.run.recompute_note,
        "collection_note": context.collection_note,
        "perturbation": _perturbation(timing, context, tflops, measured * dp, paused_s),
        "device": {"name": context.device_name, "dtype": context.dtype, "peak_tflops": peak},
        "totals": totals,
        "flops_counting": flops_counting(replica, int(context.step), context.counting_note),
        "uncounted_ops": _uncounted_ops(replica),
        "invisible_attention": _invisible_attention(replica),
        "measurement_faults": measurement_faults(replica),
        "bounding_stage": bounding["stage_id"],
        "bubble": bubble_analysis(stages, compute_s, bounding, int(context.micro_batches), span,
                                  _schedule_of(replica)) if span else None,
        "stages": stages,
        "layers": layers,
        "partition_plan": partition_plan(stages, layers, plan_parts_of(replica), rate_s, int(context.micro_batches),
                                         plan_basis(timing, paused_s), context.memory_limit_bytes,
                                         context.memory_limit_source, _schedule_of(replica)),
        "model_tree": model_tree,
        "stragglers": straggler_view(samples, pp, dp),
        "notes": notes,
    }


def measurement_faults(replica: List[dict]) -> List[dict]:
    """What the reported ranks could not measure, and why (fail_safe.py), in rank order; [] where all was."""
    return [dict(fault, global_rank=int(entry["global_rank"]), stage_id=int(entry["stage_id"]),
                 tp_rank=int(entry["tp_rank"]))
            for entry in sorted(replica, key=lambda e: e["global_rank"]) for fault in entry.get("faults") or ()]


# A profiled iteration this much slower than the steady unprofiled ones was still warming up (the profiler's own
# cost is a few percent: docs/benchmarks.md).
WARMING_UP_RATIO = 1.10


def plan_basis(timing: Optional[IterationTiming], paused_s: float = 0.0) -> Basis:
    """What the plan's times rest on: scaled from the profiled iteration to the steady unprofiled ones where the
    baseline is steady; unscaled, and said, where it is not (warm-up alone, or none). paused_s: the garbage
    collector's pauses in the profiled iteration (the most of any stage's), out of the layers' times, and so out of
    the profiled iteration they are scaled from."""
    if timing is None:
        return Basis(note="no iteration was timed unprofiled")
    unprofiled = timing.unprofiled_iter_s
    if timing.baseline_note is not None or not unprofiled:
        return Basis(iterations=tuple(timing.unprofiled_iterations), spread=timing.unprofiled_spread,
                     note=timing.baseline_note or "no iteration was timed unprofiled")
    return Basis(unprofiled / _without_pauses(timing, paused_s), tuple(timing.unprofiled_iterations),
                 timing.unprofiled_spread)


def _without_pauses(timing, paused_s):
    """The profiled iteration less the collector's pauses in it. (A guard keeps at least half of it: the pauses are
    another rank's, over its measuring window, which holds more than the iteration rank 0 timed.)"""
    return max(timing.profiled_iter_s - paused_s, timing.profiled_iter_s / 2)


def _warming_up_note(timing, paused_s) -> Optional[str]:
    unprofiled = timing.unprofiled_iter_s
    profiled = _without_pauses(timing, paused_s)
    if not unprofiled or timing.baseline_note is not None or profiled <= WARMING_UP_RATIO * unprofiled:
        return None
    without = f" without the garbage collector's {paused_s * 1000:.0f} ms of pauses" if paused_s >= 0.0005 else ""
    return (f"the profiled iteration took {profiled / unprofiled:.2f}x the steady unprofiled ones{without}: it "
            "was still warming up (the profiler's own cost is a few percent); the plan scales its measured times "
            "to the steady iterations")


def _perturbation(timing, context, report_tflops, measured_flops, paused_s):
    """The profiled iteration against the unprofiled ones (null without a timing), and the training log line's
    TFLOPs over the same unprofiled time beside the report's, with why they differ."""
    if timing is None:
        return None
    unprofiled = timing.unprofiled_iter_s
    log_flops = context.run.log_line_flops
    log_tflops = log_flops / (unprofiled * context.world_size) / 1e12 if unprofiled and log_flops is not None \
        else None
    counting_s = timing.counting_iter_s
    return {
        "profiled_iter_s": timing.profiled_iter_s,
        "unprofiled_iter_s": unprofiled,
        "unprofiled_iterations": list(timing.unprofiled_iterations),
        "log_line_flops": log_flops,
        "clock": timing.clock,
        "ratio": timing.profiled_iter_s / unprofiled if unprofiled else None,
        "counting_iter_s": counting_s,
        "counting_ratio": counting_s / unprofiled if unprofiled and counting_s is not None else None,
        "log_line_tflops": log_tflops,
        "log_line_note": log_line_note(log_tflops, report_tflops, log_flops, measured_flops)
        if log_tflops is not None else None,
        "unprofiled_spread": timing.unprofiled_spread,
        "baseline_note": timing.baseline_note,
        "warming_up_note": _warming_up_note(timing, paused_s),
    }


def log_line_note(log_tflops: float, report_tflops: float, log_flops: float, measured_flops: int) -> str:
    """One line: why the log line's TFLOPs and the report's differ, at the same time and GPU count."""
    return (f"the log line's {log_tflops:.3g} TFLOPs is Megatron-DeepSpeed's formula, {log_flops:.4g} FLOPs per "
            f"iteration of the global batch (backward = 2 x forward; under --checkpoint-activations one more forward "
            f"of every layer; LM head included), over the same time and world size; the report's {report_tflops:.3g} "
            f"counts what the kernels executed, {measured_flops:.4g} FLOPs (every replica, fwd + bwd + recompute), "
            f"so they differ by exactly the ratio of the two counts, {log_flops / measured_flops:.4f}")


def _schedule_of(replica):
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


def _invisible_attention(replica):
    """The replica's attention modules that ran a kernel torch cannot see (ModuleProfiler.invisible_attention),
    once each (a stage's tp ranks name the same module), by module path."""
    found = {}
    for entry in replica:
        for module in entry.get("invisible_attention") or ():
            known = found.setdefault(module["module"], dict(module))
            known["calls"] = max(known["calls"], module["calls"])
    return [found[path] for path in sorted(found)]


def _uncounted_ops(replica):
    """The replica's matrix-class ops without a formula, calls summed over its ranks, sorted by (op, phase)."""
    calls = {}
    for entry in replica:
        for op in entry.get("uncounted_ops", ()):
            key = (op["op"], op["phase"])
            calls[key] = calls.get(key, 0) + int(op["calls"])
    return [{"op": op, "phase": phase, "calls": n} for (op, phase), n in sorted(calls.items())]
