"""The report as text, in the layout of DeepSpeed's flops profiler, with every number meaning what it says: the
header, the notations, the summary and its warnings here, then the pipeline's sections (printed_stages.py) and the
modules' (printed_modules.py)."""
from patches.formats.text_table import labelled_line
from patches.formats.units import (
    duration_to_string,
    flops_rate_to_string,
    number_to_string,
    params_to_string,
)
from patches.profiler.instructions import BACKWARD_INSTRUCTIONS
from patches.profiler.printed_modules import detailed_tree, format_aggregated
from patches.profiler.printed_stages import (
    bubble_lines,
    instruction_tables,
    layer_table,
    memory_table,
    ranks,
    stage_table,
    straggler_table,
)

HEADER = "-------------------------- DeepSpeed Flops Profiler --------------------------"
CLOSING = "-" * 78

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
        return labelled_line(label + ":", value)

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
    lines += [line(f"params per GPU, stage {s['stage_id']} (ranks {ranks(s)})", params_to_string(s["params_per_gpu"]))
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


def format_report(report: dict, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
    """The report as text. module_depth=-1 shows every depth, k shows depths 0..k (the root is depth 0)."""
    lines = ["", HEADER, f"Profile Summary at step {report['step']}:"]
    lines += _notations(report)
    lines += _summary(report)
    lines += stage_table(report)
    lines += bubble_lines(report)
    lines += memory_table(report)
    lines += layer_table(report)
    lines += straggler_table(report)
    lines += instruction_tables(report)
    lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
    lines += format_aggregated(report, module_depth, top_modules)
    if detailed:
        lines += ["", "------------------------------ Detailed Profile per GPU ------------------------------"]
        lines += detailed_tree(report, module_depth)
    lines.append(CLOSING)
    return "\n".join(lines) + "\n"
