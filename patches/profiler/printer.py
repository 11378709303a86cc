"""The report as text, in the layout of DeepSpeed's flops profiler, with every number meaning what it says."""
from patches.formats.units import (
    bytes_to_string,
    duration_to_string,
    flops_rate_to_string,
    number_to_string,
    params_to_string,
)
from patches.partition.plan_lines import plan_line
from patches.partition.table import shared_on_one_stage
from patches.profiler.instructions import BACKWARD_INSTRUCTIONS
from patches.profiler.notes import (
    FIRST_STEP_PEAKS,
    LAYER_TABLE_CAPTION,
    MEMORY_CAPTION,
    STAGE_TABLE_CAPTION,
    STRAGGLER_TABLE_CAPTION,
)
from patches.profiler.stragglers import METRICS
from patches.profiler.tree_merge import aggregate_by_depth

HEADER = "-------------------------- DeepSpeed Flops Profiler --------------------------"
CLOSING = "-" * 78
_LINE = "{:<72}  {}"


def _percent(part, whole):
    return f"{100 * part / whole:.2f}%" if whole else "0%"


def _table(headers, rows, indent="  "):
    widths = [max(len(str(row[i])) for row in [headers] + rows) for i in range(len(headers))]
    return [indent + "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in [headers] + rows]


def _ranks(stage):
    return ",".join(str(r) for r in stage["global_ranks"])


def _notations(report):
    lines = ["Notations:",
             "pipeline parallel size (pp), tensor parallel size (tp), data parallel size (dp), "
             "number of parameters (params),",
             "floating-point operations (flops), floating-point operations per second (FLOPS), "
             "fwd (forward), bwd (backward), recompute (activation checkpointing), step (weights update),"]
    lines += [f"{note}," for note in report["notes"].values()]
    lines[-1] = lines[-1][:-1]
    return lines + [""]


def _uncounted_lines(report, line):
    ops = report.get("uncounted_ops") or []
    if not ops:
        return []
    listed = ", ".join(f"{op['op']} x{op['calls']} ({op['phase']})" for op in ops)
    return [line("uncounted ops", f"{listed}: no FLOP formula, left out of the flops (shown as >=)")]


def _invisible_attention_lines(report, line):
    hidden = report.get("invisible_attention") or []
    if not hidden:
        return []
    listed = ", ".join(f"{m['module']} ({m['type']}) x{m['calls']}" for m in hidden[:3])
    more = f" and {len(hidden) - 3} more" if len(hidden) > 3 else ""
    return [line("attention not counted", f"{listed}{more}: a kernel torch cannot see (an older flash-attn, "
                                          "Triton, DeepSpeed's builder), its attention FLOPs left out (shown as >=)")]


def _fault_lines(report, line):
    """One line per part a rank could not measure (fail_safe.py), in the summary where a reader looks first."""
    return [line("not measured", f"{fault['part']} of stage {fault['stage_id']} (rank {fault['global_rank']}): "
                                 f"failed in {fault['where']}: {fault['error']} (the profiler's error: the "
                                 "iteration ran on, the rest of this report stands)")
            for fault in report.get("measurement_faults") or ()]


def warning_lines(report: dict) -> list:
    """The summary's lines a reader must not miss (uncounted ops, attention not counted, parts not measured), each
    'label: text': the profile page lists them as the printed report words them."""
    def line(label, value):
        return f"{label}: {value}"
    return _uncounted_lines(report, line) + _invisible_attention_lines(report, line) + _fault_lines(report, line)


def _perturbation_lines(report, line):
    """The profiled iteration, and the one that counted its FLOPs, against unprofiled ones of the same run: what
    profiling cost the run."""
    perturbation = report.get("perturbation")
    if perturbation is None:
        return []
    lines = [line("profiled iteration (wall, the train step)", duration_to_string(perturbation["profiled_iter_s"]))]
    counting_s = perturbation.get("counting_iter_s")
    if counting_s is not None:
        counted = report["flops_counting"]["counted_iteration"]
        lines.append(line(f"counting iteration {counted} (wall, the train step, its FLOPs counted)",
                          duration_to_string(counting_s)))
    note = perturbation.get("baseline_note")
    if perturbation["unprofiled_iter_s"] is None:
        return lines + [line("unprofiled iteration", "n/a: none was timed; rates below are the profiled "
                                                     "iteration's")]
    iterations = perturbation["unprofiled_iterations"]
    which = f"{iterations[0]}-{iterations[-1]}" if len(iterations) > 1 else f"{iterations[0]}"
    spread = perturbation.get("unprofiled_spread")
    spread_words = f", spread {100 * spread:.1f}%" if spread is not None else ""
    lines += [
        line(f"unprofiled iter time (median of iterations {which}{spread_words}, same clock)",
             duration_to_string(perturbation["unprofiled_iter_s"])),
        line("perturbation = profiled / unprofiled", f"{perturbation['ratio']:.3f}"),
    ]
    if perturbation.get("counting_ratio") is not None:
        lines.append(line("counting iteration / unprofiled", f"{perturbation['counting_ratio']:.3f}"))
    lines.append(line("baseline", note or perturbation.get("warming_up_note")
                      or "steady: unprofiled iterations past the warm-up and the counting one"))
    return lines


def _log_line_lines(report, line):
    """The training log line's TFLOPs for the same time, and why it differs from the report's."""
    perturbation = report.get("perturbation")
    if perturbation is None or perturbation.get("log_line_tflops") is None:
        return []
    return [line("training log line's TFLOPs at the unprofiled iter time", f"{perturbation['log_line_tflops']:.3g}"),
            line("why they differ", perturbation["log_line_note"])]


def _flops_of_model(report, prefix):
    """A phase with uncounted ops, or any phase of a model with uncounted attention, did at least this much:
    never shown as an exact number."""
    text = number_to_string(report["totals"][f"{prefix}_flops"])
    if any(op["phase"] == prefix for op in report.get("uncounted_ops") or ()) or \
            (report.get("invisible_attention") and report["totals"][f"{prefix}_flops"]):
        return ">= " + text
    return text


def _recomputed_per_stage(report) -> str:
    """'stage 0: layers 1, 2 of 3; stage 1: none of 4' from the layer table (the layers whose recompute ran: their
    recompute FLOPs); '' where nothing recomputed or the report has no layer table."""
    layers = report.get("layers") or []
    if not any(row["recompute_flops"] for row in layers):
        return ""
    parts = []
    for stage in report["stages"]:
        rows = [row for row in layers if row["stage"] == stage["stage_id"]]
        recomputed = [str(row["index"]) for row in rows if row["recompute_flops"]]
        which = (f"layer{'s' if len(recomputed) > 1 else ''} {', '.join(recomputed)}" if recomputed else "none")
        parts.append(f"stage {stage['stage_id']}: {which} of {len(rows)}")
    return "; ".join(parts)


def _summary(report):
    totals, par = report["totals"], report["parallelism"]
    pp, tp, dp = par["pipeline_parallel_size"], par["tensor_parallel_size"], par["data_parallel_size"]
    bounding = report["bounding_stage"]
    device = report["device"]
    model_flops = totals["fwd_flops"] + totals["bwd_flops"] + totals["recompute_flops"]
    # the rates' time: the unprofiled iterations' where the run timed them (report.build_report)
    time = "unprofiled iter time" if totals.get("throughput_basis") == "unprofiled" else "iter latency"

    def line(label, value):
        return _LINE.format(label + ":", value)

    lines = [
        line("world size = pp * tp * dp", f"{par['world_size']} = {pp} * {tp} * {dp}"),
        line("micro-batches * micro-batch size (per replica)", f"{par['micro_batches']} * {par['micro_batch_size']}"),
        line("seq length", par["seq_length"] if par.get("seq_length") else "n/a"),
        line("activation checkpointing", "yes" if report["activation_checkpointing"] else "no"),
        *([line("recomputed layers", report["recompute_note"])] if report.get("recompute_note") else []),
        *([line("layers recomputed, per stage", _recomputed_per_stage(report))]
          if _recomputed_per_stage(report) else []),
        *([line("collected", report["collection_note"])] if report.get("collection_note") else []),
        *([line("flops counted", report["flops_counting"]["note"])] if report.get("flops_counting") else []),
        *([line("optimizer step", "skipped (fp16 loss-scale overflow): no update in the step latency")]
          if report.get("optimizer_step_skipped") else []),
        line("device, dtype, dense peak", f"{device['name']}, {device['dtype']}, "
             + (f"{device['peak_tflops']:g} TFLOPS" if device["peak_tflops"] else "unknown")),
    ]
    lines += [line(f"params per GPU, stage {s['stage_id']} (ranks {_ranks(s)})", params_to_string(s["params_per_gpu"]))
              for s in report["stages"]]
    lines += [
        line("params of model (tp shards summed, replicated and tied params once)", params_to_string(totals["params"])),
        line("fwd flops of model", _flops_of_model(report, "fwd")),
        line("bwd flops of model", _flops_of_model(report, "bwd")),
        line("recompute flops of model", _flops_of_model(report, "recompute")),
        *_uncounted_lines(report, line),
        *_invisible_attention_lines(report, line),
        *_fault_lines(report, line),
        line("fwd / bwd / recompute flops per GPU = flops of model / (pp * tp)",
             " / ".join(number_to_string(totals[k] / (pp * tp))
                        for k in ("fwd_flops", "bwd_flops", "recompute_flops"))),
        line(f"fwd latency (ForwardPass of stage {bounding}, the bounding stage)",
             duration_to_string(totals["fwd_latency_s"])),
        line(f"bwd latency ({_backward_instructions(report)} of stage {bounding})",
             duration_to_string(totals["bwd_latency_s"])),
        line(f"step latency (OptimizerStep of stage {bounding})", duration_to_string(totals["step_latency_s"])),
        line("iter latency = largest stage train_batch time", duration_to_string(totals["iter_latency_s"])),
        *_perturbation_lines(report, line),
        line(f"hardware FLOPS per GPU = (fwd + bwd + recompute flops) / {time} / (pp * tp)",
             flops_rate_to_string(totals["tflops_per_gpu"] * 1e12)),
        line(f"model FLOPS per GPU = (fwd + bwd flops) / {time} / (pp * tp)",
             flops_rate_to_string(totals["model_tflops_per_gpu"] * 1e12)),
        line(f"samples/second = micro-batches * micro-batch size * dp / {time}", f"{totals['samples_per_s']:.2f}"),
        line("tokens/second = samples/second * seq length",
             f"{totals['tokens_per_s']:.2f}" if totals.get("tokens_per_s") is not None else "n/a: seq length unknown"),
        line("MFU = model FLOPS per GPU / dense peak of the device",
             f"{100 * totals['mfu']:.2f}%" if totals["mfu"] is not None
             else "n/a: device peak unknown, pass --peak-tflops"),
        *_log_line_lines(report, line),
    ]
    if totals.get("analytic") is not None:
        analytic = totals["analytic"]
        lines += [
            line("analytic flops of model (Megatron-LM formula)",
                 f"{number_to_string(totals['analytic_flops'])} (fwd {number_to_string(analytic['fwd_flops'])} + "
                 f"bwd {number_to_string(analytic['bwd_flops'])} + "
                 f"recompute {number_to_string(analytic['recompute_flops'])})"),
            line("measured flops of model (fwd + bwd + recompute)", number_to_string(model_flops)),
            line("measured / analytic", f"{totals['measured_over_analytic']:.4f}" + (
                f" (short: the attention of {len(report['invisible_attention'])} module(s) is not counted)"
                if report.get("invisible_attention") else "")),
        ]
    else:
        lines.append(line("analytic flops of model (Megatron-LM formula)", "n/a: not given"))
    return lines


def _backward_instructions(report):
    """'BackwardPass', or the backward instructions the bounding stage ran ('BackwardOnlyPass + WeightPass')."""
    ran = report["stages"][report["bounding_stage"]]["instructions"]
    return " + ".join(name for name in BACKWARD_INSTRUCTIONS if name in ran) or "BackwardPass"


# The pauses are left out of every module's time and of the plan's layer times (gc_pauses.py).
GC_LABEL = "garbage collection in the profiled iteration, in no module's time"


def _stage_table(report):
    headers = ["stage", "ranks", "params", "fwd flops", "bwd flops", "recompute flops", "fwd", "bwd", "step",
               "comm+wait", "other", "train_batch", "share", "FLOPS per GPU"]
    rows = []
    for s in report["stages"]:
        marker = " *" if s["stage_id"] == report["bounding_stage"] else ""
        rows.append([f"{s['stage_id']}{marker}", _ranks(s), params_to_string(s["params"]),
                     number_to_string(s["fwd_flops"]), number_to_string(s["bwd_flops"]),
                     number_to_string(s["recompute_flops"])]
                    + [duration_to_string(s[k]) for k in ("fwd_latency_s", "bwd_latency_s", "step_latency_s",
                                                          "comm_s", "other_s", "train_batch_latency_s")]
                    + [f"{100 * s['busy_share']:.2f}%", flops_rate_to_string(s["tflops_per_gpu"] * 1e12)])
    time = "unprofiled iter time" if report["totals"].get("throughput_basis") == "unprofiled" else "iter latency"
    return (["", STAGE_TABLE_CAPTION]
            + _table(headers, rows)
            + ["  * bounds the iteration (largest fwd + bwd + step time); "
               "share = (fwd + bwd + step) / iter latency; FLOPS per GPU = the stage's (fwd + bwd + recompute "
               f"flops) / {time} / tp"]
            + _gc_line(report["stages"]))


def _gc_line(stages):
    """The garbage collector's pauses in each stage's profiled iteration (its most paused tp rank), which no
    module's time includes; none for a report from before they were measured."""
    paused = [stage for stage in stages if stage.get("gc")]
    if not paused:
        return []
    return ["  " + GC_LABEL + ": " + "; ".join(
        f"stage {stage['stage_id']} {duration_to_string(stage['gc']['pause_s'])} in {stage['gc']['collections']} "
        f"collections ({stage['gc']['generation_2']} full, the longest "
        f"{duration_to_string(stage['gc']['longest_s'])})" for stage in paused)]


def _bubble(report):
    bubble = report.get("bubble")
    if bubble is None:
        return []
    par = report["parallelism"]
    pp, m = par["pipeline_parallel_size"], par["micro_batches"]
    bounding = bubble["bounding_stage"]
    known = bubble.get("ideal_fraction") is not None
    rows = [[f"{row['stage_id']}{' *' if row['stage_id'] == bounding else ''}", duration_to_string(row["compute_s"]),
             duration_to_string(row["idle_s"]), f"{100 * row['idle_fraction']:.2f}%",
             f"{100 * row['over_ideal']:+.2f} pts" if known else "n/a", duration_to_string(row["wait_for_bounding_s"])]
            for row in bubble["stages"]]
    waits = [row["wait_for_bounding_s"] for row in bubble["stages"] if row["stage_id"] != bounding]
    schedule = bubble.get("schedule")
    if not known:
        ideal = (f"schedule {schedule}, pp = {pp}, micro-batches = {m}; its ideal idle fraction is not known to the "
                 "profiler, so no stage is compared with it")
    elif schedule in (None, "TrainSchedule"):
        ideal = (f"1F1B, pp = {pp}, micro-batches = {m}; ideal idle fraction (pp - 1) / (micro-batches + pp - 1) = "
                 f"{100 * bubble['ideal_fraction']:.2f}%")
    else:
        ideal = (f"{bubble['ideal_name']} ({schedule}), pp = {pp}, micro-batches = {m}; ideal idle fraction "
                 f"{bubble['ideal_formula']} = {100 * bubble['ideal_fraction']:.2f}%")
    lines = ["", f"Pipeline bubble ({ideal}):",
             f"  schedule span (stage 0's first instruction to the last backward instruction, clocks aligned to rank 0 "
             f"within {duration_to_string(bubble['clock_error_s'])}): {duration_to_string(bubble['schedule_span_s'])}"]
    lines += _table(["stage", "fwd+bwd", "idle", "idle fraction", "vs ideal", f"waits for stage {bounding}"], rows)
    if waits:
        lines.append(f"  * stage {bounding} bounds the iteration; the other stages wait for it "
                     f"{' / '.join(duration_to_string(w) for w in waits)} per iteration "
                     f"(its fwd + bwd + step minus theirs)")
    else:
        lines.append(f"  * stage {bounding} is the only stage")
    return lines


def _memory(report):
    """Each stage's memory per GPU, in the summary's layout: what it holds, what it keeps per micro-batch, the
    peak predicted from them beside the one the allocator measured."""
    stages = [s for s in report["stages"] if s.get("memory")]
    if not stages:
        return []

    def line(label, value):
        return _LINE.format("  " + label + ":", value)

    lines = ["", MEMORY_CAPTION]
    for stage in stages:
        memory = stage["memory"]
        lines += [f"stage {stage['stage_id']} (rank {memory['global_rank']}, iteration {memory['iteration']}):",
                  line("state = params + grads + optimizer",
                       f"{bytes_to_string(memory['state_bytes'])} = {bytes_to_string(memory['param_bytes'])} + "
                       f"{bytes_to_string(memory['grad_bytes'])} + {bytes_to_string(memory['optimizer_bytes'])}"),
                  line("layers' activations kept per micro-batch", bytes_to_string(memory["layer_activation_bytes"]))]
        if memory["predicted_peak_bytes"] is None:
            lines.append(line("peak", f"n/a: the allocator was not read ({memory['not_read']})"))
            continue
        lines += [
            line("kept per micro-batch in flight (layers + outside them)",
                 f"{bytes_to_string(memory['kept_bytes_per_micro_batch'])} x "
                 f"{memory['in_flight_micro_batches']} in flight"),
            line("base (alive at the start besides the state)", bytes_to_string(memory["base_bytes"])),
            line("transients (compute / step)", f"{bytes_to_string(memory['compute_transient_bytes'])} / "
                                                f"{bytes_to_string(memory['step_transient_bytes'])}"),
            line("predicted peak = base + state + max(in flight x kept + compute transient, step transient)",
                 bytes_to_string(memory["predicted_peak_bytes"])),
            line("measured peak", f"{bytes_to_string(memory['measured_peak_bytes'])} (in "
                                  f"{memory['measured_peak_instruction'] or 'no instruction'})"),
        ]
        if memory.get("fixed_buffer_bytes"):  # null or absent in a report from before it was measured
            lines.append(line("of the step transient, fixed-size buffers (ZeRO's reduction buckets)",
                              bytes_to_string(memory["fixed_buffer_bytes"])))
        if memory["optimizer_created_bytes"]:  # the process's first step: the peaks part (docs/profiling.md)
            lines += [line("optimizer state created in its step (a first step)",
                           bytes_to_string(memory["optimizer_created_bytes"])),
                      "    " + FIRST_STEP_PEAKS]
    basis = next(s["memory"]["basis"] for s in stages)
    if basis:
        lines.append(f"  allocator: {basis}")
    return lines


def _layers(report):
    """Each layer's work per iteration, and the partition the measured layers ask for."""
    rows = report.get("layers")
    if not rows:
        return []
    memory = any(row.get("activation_bytes") is not None for row in rows)
    table = [[row["index"], row["type"], row["stage"], duration_to_string(row["fwd_latency_s"]),
              duration_to_string(row["bwd_latency_s"]), duration_to_string(row["recompute_latency_s"]),
              number_to_string(row["fwd_flops"] + row["bwd_flops"] + row["recompute_flops"]),
              params_to_string(row["params"])]
             + ([_bytes_or_na(row.get("activation_bytes")), _bytes_or_na(row.get("state_bytes"))] if memory else [])
             for row in rows]
    lines = ["", LAYER_TABLE_CAPTION]
    lines += _table(["layer", "type", "stage", "fwd", "bwd", "recompute", "flops", "params"]
                    + (["kept/micro-batch", "state"] if memory else []), table)
    for indices in shared_on_one_stage(rows):
        lines.append(f"  layers {' and '.join(str(i) for i in indices)} ran one tied module on one stage: its time "
                     "and FLOPs are split evenly between them here, and no partition is planned from them")
    plan = report.get("partition_plan")
    if plan:
        lines.append("  " + plan_line(plan))
    return lines


def _bytes_or_na(value):
    return bytes_to_string(value) if value is not None else "n/a"


def _stragglers(report: dict) -> list:
    """Each stage's timings over the data-parallel replicas (absent from schema version 1 reports)."""
    view = report.get("stragglers")
    if not view:
        return []
    rows = []
    for stage in view["stages"]:
        for field, label in METRICS:
            spread = stage[field]
            ranks = ",".join(str(r) for r in spread["slowest_ranks"])
            rows.append([stage["stage_id"], label] + [duration_to_string(spread[k]) for k in ("min", "median", "max")]
                        + [f"dp {spread['slowest_dp_rank']} (ranks {ranks})"])
    replicas = view["stages"][0]["replicas"]
    return (["", STRAGGLER_TABLE_CAPTION]
            + _table(["stage", "time", "min", "median", "max", f"slowest of {replicas} replicas"], rows))


def _instruction_tables(report):
    lines = []
    for s in report["stages"]:
        train_batch = s["train_batch_latency_s"]
        rows = [[name, i["count"], duration_to_string(i["total_s"]), _percent(i["total_s"], train_batch)]
                for name, i in s["instructions"].items()]
        rows.append(["all instructions", "", duration_to_string(s["instructions_s"]),
                     _percent(s["instructions_s"], train_batch)])
        memory = bytes_to_string(s["peak_memory_bytes"]) if s.get("peak_memory_bytes") is not None else "n/a"
        lines += ["", f"Instructions of stage {s['stage_id']} (ranks {_ranks(s)}; train_batch "
                      f"{duration_to_string(train_batch)}, peak memory {memory}):"]
        lines += _table(["instruction", "count", "total", "% of train_batch"], rows)
    return lines


def format_aggregated(report: dict, module_depth: int = -1, top_modules: int = 1) -> list:
    """The Aggregated Profile's lines: per depth, the top module types of the whole-model tree."""
    depths = aggregate_by_depth(report["model_tree"])
    last = len(depths) - 1 if module_depth < 0 else min(module_depth, len(depths) - 1)
    lines = [f"Top {top_modules} modules in terms of params, flops (fwd + bwd + recompute) or latency at "
             "different model depths,",
             "each type summed over its modules at that depth in the whole-model tree (all stages, tp shards "
             "summed; latencies the largest tp rank's, summed over stages):"]
    columns = (("params", "params", params_to_string), ("flops", "flops", number_to_string),
               ("fwd latency", "fwd_latency_s", duration_to_string),
               ("bwd latency", "bwd_latency_s", duration_to_string),
               ("recompute latency", "recompute_latency_s", duration_to_string))
    for depth in range(last + 1):
        by_type = depths[depth]
        total = {key: sum(row[key] for row in by_type.values()) for _, key, _ in columns}
        lines.append(f"depth {depth} (all {sum(r['count'] for r in by_type.values())} modules: "
                     + ", ".join(f"{label} {fmt(total[key])}" for label, key, fmt in columns) + "):")
        for label, key, fmt in columns:
            top = sorted(by_type.items(), key=lambda item: item[1][key], reverse=True)[:top_modules]
            lines.append(f"    {label:<17} - {dict((name, fmt(row[key])) for name, row in top)}")
    return lines


def _node_summary(node, root, tp):
    flops = node["fwd_flops"] + node["bwd_flops"] + node["recompute_flops"]
    latency = node["fwd_latency_s"] + node["bwd_latency_s"] + node["recompute_latency_s"]
    root_flops = root["fwd_flops"] + root["bwd_flops"] + root["recompute_flops"]
    return (f"{params_to_string(node['params'])} = {_percent(node['params'], root['params'])} Params, "
            f"fwd {number_to_string(node['fwd_flops'])} + bwd {number_to_string(node['bwd_flops'])} + "
            f"recompute {number_to_string(node['recompute_flops'])} flops = {_percent(flops, root_flops)} flops, "
            f"fwd {duration_to_string(node['fwd_latency_s'])}, bwd {duration_to_string(node['bwd_latency_s'])}, "
            f"recompute {duration_to_string(node['recompute_latency_s'])}, "
            f"{flops_rate_to_string(flops / tp / latency if latency else 0)}")


def _tree(node, root, tp, depth, module_depth, indent, label):
    shown = node["children"] if module_depth < 0 or depth < module_depth else []
    head = f"{indent}{label}{node['type']}("
    if not shown:
        return [f"{head}{_node_summary(node, root, tp)})"]
    lines = [head, f"{indent}  {_node_summary(node, root, tp)},"]
    for child in shown:
        lines += _tree(child, root, tp, depth + 1, module_depth, indent + "  ", f"({child['name']}): ")
    return lines + [f"{indent})"]


def _detailed(report, module_depth):
    tp = report["parallelism"]["tensor_parallel_size"]
    root = report["model_tree"]
    return [
        "Each module profile is listed after its name in the following order:",
        "params = % of model params, fwd + bwd + recompute flops = % of model flops, fwd latency, bwd latency, "
        "recompute latency, FLOPS per GPU = its flops / tp / its (fwd + bwd + recompute) latency",
        "",
        "Note: 1. The tree is the whole model: every stage's modules under one root, layers under their global "
        "index. Params and flops are summed over tp shards (replicated params once); latencies are the largest tp "
        "rank's; a module held by several stages (tied) has its params once and its flops and latencies summed "
        "over stages, as has the root.",
        "2. Params, flops and latencies are inclusive: a module's include its submodules'. Work done outside any "
        "submodule (functional calls, the loss) makes up the difference between a module and the sum of its "
        "submodules.",
        "3. Latencies are device-synchronized, measured on the module itself, forward, backward and recompute apart.",
        "",
    ] + _tree(root, root, tp, 0, module_depth, "", "")


def format_report(report: dict, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
    """The report as text. module_depth=-1 shows every depth, k shows depths 0..k (the root is depth 0)."""
    lines = ["", HEADER, f"Profile Summary at step {report['step']}:"]
    lines += _notations(report)
    lines += _summary(report)
    lines += _stage_table(report)
    lines += _bubble(report)
    lines += _memory(report)
    lines += _layers(report)
    lines += _stragglers(report)
    lines += _instruction_tables(report)
    lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
    lines += format_aggregated(report, module_depth, top_modules)
    if detailed:
        lines += ["", "------------------------------ Detailed Profile per GPU ------------------------------"]
        lines += _detailed(report, module_depth)
    lines.append(CLOSING)
    return "\n".join(lines) + "\n"
