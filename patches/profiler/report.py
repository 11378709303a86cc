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
from typing import List, Optional

from patches.partition.report_plan import partition_plan, plan_parts_of
from patches.partition.table import layer_table
from patches.profiler.context import ReportContext
from patches.profiler.instructions import BACKWARD_INSTRUCTIONS, FORWARD_INSTRUCTIONS
from patches.profiler.memory_report import add_layer_memory, per_gpu
from patches.profiler.notes import NOTES
from patches.profiler.report_replica import (
    flops_counting,
    invisible_attention,
    measurement_faults,
    schedule_of,
    uncounted_ops,
)
from patches.profiler.report_stages import bubble_analysis, build_stage, instruction_s, schedule_span
from patches.profiler.report_timing import perturbation, plan_basis
from patches.profiler.shared_cpus import shared_cpus_of
from patches.profiler.stragglers import RankSample, straggler_view
from patches.profiler.tree_merge import merge_stage_trees

SCHEMA_VERSION = 2


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
        stages.append(build_stage(stage_id, replica, max_dp_s))
        memory = per_gpu(replica, int(context.step))
        stages[-1]["memory"] = memory[0] if memory is not None else None
        if memory is not None:
            memory_from[stage_id] = memory[1]
    replica = rank_entries
    span = schedule_span(replica)
    compute_s = {stage_id: max(instruction_s(e["instructions"], FORWARD_INSTRUCTIONS + BACKWARD_INSTRUCTIONS)
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
        "perturbation": perturbation(timing, context, tflops, measured * dp, paused_s),
        "device": {"name": context.device_name, "dtype": context.dtype, "peak_tflops": peak},
        "totals": totals,
        "flops_counting": flops_counting(replica, int(context.step), context.counting_note),
        "uncounted_ops": uncounted_ops(replica),
        "invisible_attention": invisible_attention(replica),
        "measurement_faults": measurement_faults(replica),
        "bounding_stage": bounding["stage_id"],
        "bubble": bubble_analysis(stages, compute_s, bounding, int(context.micro_batches), span,
                                  schedule_of(replica)) if span else None,
        "stages": stages,
        "layers": layers,
        "partition_plan": partition_plan(stages, layers, plan_parts_of(replica), rate_s, int(context.micro_batches),
                                         plan_basis(timing, paused_s,
                                                    shared_cpus_of(replica, tp, dp, context.device_name)),
                                         context.memory_limit_bytes,
                                         context.memory_limit_source, schedule_of(replica)),
        "model_tree": model_tree,
        "stragglers": straggler_view(samples, pp, dp),
        "notes": notes,
    }
