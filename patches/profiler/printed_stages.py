"""The report's pipeline sections as text: the stage table, the bubble, each stage's memory, the layer table
with the plan under it, the straggler table and each stage's instructions (printer.format_report prints them in
this order, after the summary)."""
from patches.formats.text_table import labelled_line, percent, table
from patches.formats.units import (
    bytes_to_string,
    duration_to_string,
    flops_rate_to_string,
    number_to_string,
    params_to_string,
)
from patches.partition.plan_lines import under_the_layer_table
from patches.profiler.notes import (
    FIRST_STEP_PEAKS,
    LAYER_TABLE_CAPTION,
    MEMORY_CAPTION,
    STAGE_TABLE_CAPTION,
    STRAGGLER_TABLE_CAPTION,
)
from patches.profiler.stragglers import METRICS


def ranks(stage: dict) -> str:
    """'0,2': a stage's global ranks."""
    return ",".join(str(r) for r in stage["global_ranks"])


# The pauses are left out of every module's time and of the plan's layer times (gc_pauses.py).
GC_LABEL = "garbage collection in the profiled iteration, in no module's time"


def stage_table(report: dict) -> list:
    headers = ["stage", "ranks", "params", "fwd flops", "bwd flops", "recompute flops", "fwd", "bwd", "step",
               "comm+wait", "other", "train_batch", "share", "FLOPS per GPU"]
    rows = []
    for s in report["stages"]:
        marker = " *" if s["stage_id"] == report["bounding_stage"] else ""
        rows.append([f"{s['stage_id']}{marker}", ranks(s), params_to_string(s["params"]),
                     number_to_string(s["fwd_flops"]), number_to_string(s["bwd_flops"]),
                     number_to_string(s["recompute_flops"])]
                    + [duration_to_string(s[k]) for k in ("fwd_latency_s", "bwd_latency_s", "step_latency_s",
                                                          "comm_s", "other_s", "train_batch_latency_s")]
                    + [f"{100 * s['busy_share']:.2f}%", flops_rate_to_string(s["tflops_per_gpu"] * 1e12)])
    time = "unprofiled iter time" if report["totals"].get("throughput_basis") == "unprofiled" else "iter latency"
    return (["", STAGE_TABLE_CAPTION]
            + table(headers, rows)
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


def bubble_lines(report: dict) -> list:
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
    lines += table(["stage", "fwd+bwd", "idle", "idle fraction", "vs ideal", f"waits for stage {bounding}"], rows)
    if waits:
        lines.append(f"  * stage {bounding} bounds the iteration; the other stages wait for it "
                     f"{' / '.join(duration_to_string(w) for w in waits)} per iteration "
                     f"(its fwd + bwd + step minus theirs)")
    else:
        lines.append(f"  * stage {bounding} is the only stage")
    return lines


def memory_table(report: dict) -> list:
    """Each stage's memory per GPU, in the summary's layout: what it holds, what it keeps per micro-batch, the
    peak predicted from them beside the one the allocator measured."""
    stages = [s for s in report["stages"] if s.get("memory")]
    if not stages:
        return []

    def line(label, value):
        return labelled_line("  " + label + ":", value)

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


def layer_table(report: dict) -> list:
    """Each layer's work per iteration, and the partition the measured layers ask for."""
    rows = report.get("layers")
    if not rows:
        return []
    memory = any(row.get("activation_bytes") is not None for row in rows)
    cells = [[row["index"], row["type"], row["stage"], duration_to_string(row["fwd_latency_s"]),
              duration_to_string(row["bwd_latency_s"]), duration_to_string(row["recompute_latency_s"]),
              number_to_string(row["fwd_flops"] + row["bwd_flops"] + row["recompute_flops"]),
              params_to_string(row["params"])]
             + ([_bytes_or_na(row.get("activation_bytes")), _bytes_or_na(row.get("state_bytes"))] if memory else [])
             for row in rows]
    lines = ["", LAYER_TABLE_CAPTION]
    lines += table(["layer", "type", "stage", "fwd", "bwd", "recompute", "flops", "params"]
                   + (["kept/micro-batch", "state"] if memory else []), cells)
    return lines + under_the_layer_table(rows, report.get("partition_plan"))


def _bytes_or_na(value):
    return bytes_to_string(value) if value is not None else "n/a"


def straggler_table(report: dict) -> list:
    """Each stage's timings over the data-parallel replicas (absent from schema version 1 reports)."""
    view = report.get("stragglers")
    if not view:
        return []
    rows = []
    for stage in view["stages"]:
        for field, label in METRICS:
            spread = stage[field]
            slowest = ",".join(str(r) for r in spread["slowest_ranks"])
            rows.append([stage["stage_id"], label] + [duration_to_string(spread[k]) for k in ("min", "median", "max")]
                        + [f"dp {spread['slowest_dp_rank']} (ranks {slowest})"])
    replicas = view["stages"][0]["replicas"]
    return (["", STRAGGLER_TABLE_CAPTION]
            + table(["stage", "time", "min", "median", "max", f"slowest of {replicas} replicas"], rows))


def instruction_tables(report: dict) -> list:
    lines = []
    for s in report["stages"]:
        train_batch = s["train_batch_latency_s"]
        rows = [[name, i["count"], duration_to_string(i["total_s"]), percent(i["total_s"], train_batch)]
                for name, i in s["instructions"].items()]
        rows.append(["all instructions", "", duration_to_string(s["instructions_s"]),
                     percent(s["instructions_s"], train_batch)])
        memory = bytes_to_string(s["peak_memory_bytes"]) if s.get("peak_memory_bytes") is not None else "n/a"
        lines += ["", f"Instructions of stage {s['stage_id']} (ranks {ranks(s)}; train_batch "
                      f"{duration_to_string(train_batch)}, peak memory {memory}):"]
        lines += table(["instruction", "count", "total", "% of train_batch"], rows)
    return lines
