"""Plot a FLOPs profile: where each pipeline stage's time goes, and the schedule as it ran.

    megatron-plot-profile out/flops_profile_step2.json -o profile.png [--trace TRACE.json]

Top: one stacked bar per stage (forward, backward, recompute, communication and wait, optimizer
step, other), in milliseconds of the profiled iteration, with the stage's idle fraction against the
ideal 1F1B bubble. Bottom: a Gantt chart of the schedule from the Chrome trace written beside the
report (pipeline_trace_step{N}.json), one row per stage and tensor rank, micro-batch numbers on the
forward and backward passes, recompute drawn over the backward passes that ran it.
Needs matplotlib (pip install matplotlib; the 'plot' extra).
"""
import argparse
import json
import os
import sys

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from patches.formats.units import flops_rate_to_string
from patches.profiler.trace import INSTRUCTION_CATEGORY, module_category

# The parts of a stage's iteration, bottom to top, with their colours (shared by both panels).
PARTS = (("forward", "#4c72b0"), ("backward", "#dd8452"), ("recompute", "#c44e52"),
         ("communication + wait", "#8c8c8c"), ("optimizer step", "#8172b3"), ("other", "#ccb974"))
COLOURS = dict(PARTS)
# Gantt colour of each schedule instruction, by the part of the time it belongs to.
INSTRUCTION_PART = {"ForwardPass": "forward", "BackwardPass": "backward", "BackwardOnlyPass": "backward",
                    "WeightPass": "backward", "SendActivation": "communication + wait",
                    "RecvActivation": "communication + wait", "SendGrad": "communication + wait",
                    "RecvGrad": "communication + wait", "ReduceGrads": "communication + wait",
                    "ReduceTiedGrads": "communication + wait", "OptimizerStep": "optimizer step",
                    "LoadMicroBatch": "other"}


def stage_parts(stage):
    """{part: seconds} of one stage; they add up to its instructions' time plus the untimed rest.

    BackwardPass time includes the recompute that activation checkpointing runs inside it: the
    recompute (the stage module's measured recompute latency) is taken out of backward and shown apart.
    """
    recompute = min(stage["modules"]["recompute_latency_s"], stage["bwd_latency_s"])
    return {
        "forward": stage["fwd_latency_s"],
        "backward": stage["bwd_latency_s"] - recompute,
        "recompute": recompute,
        "communication + wait": stage["comm_s"] + stage["reduce_s"],
        "optimizer step": stage["step_latency_s"],
        "other": stage["load_s"] + stage["other_s"],
    }


def default_trace_path(report_path, report):
    return os.path.join(os.path.dirname(os.path.abspath(report_path)), f"pipeline_trace_step{report['step']}.json")


def _stage_label(stage):
    return f"stage {stage['stage_id']}\nranks {','.join(str(r) for r in stage['global_ranks'])}"


def _plot_bars(ax, report):
    stages = report["stages"]
    idle = {row["stage_id"]: row for row in report["bubble"]["stages"]} if report.get("bubble") else {}
    positions = range(len(stages))
    bottoms = [0.0] * len(stages)
    for part, colour in PARTS:
        heights = [stage_parts(stage)[part] * 1e3 for stage in stages]
        ax.bar(positions, heights, bottom=bottoms, color=colour, label=part, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.axhline(report["totals"]["iter_latency_s"] * 1e3, color="black", linestyle="--", linewidth=1,
               label="iteration latency")
    for position, stage, top in zip(positions, stages, bottoms):
        note = "bounds the iteration\n" if stage["stage_id"] == report["bounding_stage"] else ""
        if stage["stage_id"] in idle:
            note += f"idle {100 * idle[stage['stage_id']]['idle_fraction']:.1f}%"
        ax.annotate(note, (position, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(list(positions), [_stage_label(stage) for stage in stages])
    ax.set_ylabel("time in the profiled iteration (ms)")
    ax.set_ylim(0, max(bottoms + [report["totals"]["iter_latency_s"] * 1e3]) * 1.2)
    title = "Where each stage's time goes"
    bubble = report.get("bubble")
    if bubble and bubble.get("ideal_fraction") is not None:
        title += f" (ideal {bubble.get('ideal_name') or '1F1B'} idle {100 * bubble['ideal_fraction']:.1f}%)"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _plot_gantt(ax, trace):
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    tracks = sorted({(e["pid"], e["tid"]) for e in slices if e["cat"] == INSTRUCTION_CATEGORY})
    row_of = {track: row for row, track in enumerate(tracks)}
    by_part = {}
    for e in slices:
        if e["cat"] != INSTRUCTION_CATEGORY:
            continue
        part = INSTRUCTION_PART.get(e["args"]["instruction"], "other")
        spans = by_part.setdefault(part, {}).setdefault(row_of[(e["pid"], e["tid"])], [])
        spans.append((e["ts"] / 1e3, e["dur"] / 1e3))
    end = max(e["ts"] + e["dur"] for e in slices) / 1e3
    for part, rows in by_part.items():
        for row, spans in rows.items():
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS[part], edgecolor="white", linewidth=0.3)
    # The stage module's recompute stretches: thin bars inside the backward passes that ran them.
    for e in slices:
        if e["cat"] == module_category("recompute") and e["args"]["depth"] == 0:
            row = row_of[(e["pid"], e["tid"])]
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (row - 0.15, 0.3), facecolors=COLOURS["recompute"])
    for e in slices:  # micro-batch numbers where they fit
        if e["cat"] == INSTRUCTION_CATEGORY and e["args"]["instruction"] in ("ForwardPass", "BackwardPass") \
                and e["dur"] / 1e3 > end / 60:
            prefix = "F" if e["args"]["instruction"] == "ForwardPass" else "B"
            ax.text((e["ts"] + e["dur"] / 2) / 1e3, row_of[(e["pid"], e["tid"])] + 0.3,
                    f"{prefix}{e['args']['micro_batch']}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(tracks)), [f"stage {pid} tp {tid}" for pid, tid in tracks])
    ax.set_ylim(len(tracks) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, end)
    ax.set_xlabel("time (ms from the first instruction, every rank on rank 0's clock)")
    error = trace["otherData"]["clock_sync"]["max_error_s"]
    ax.set_title(f"Schedule as it ran (F = forward, B = backward of micro-batch k; clocks aligned within "
                 f"{error * 1e6:.0f} us)", fontsize=10)
    ax.legend(handles=[Patch(color=colour, label=part) for part, colour in PARTS if part in by_part or
                       part == "recompute"], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_profile(report, trace=None):
    """The figure: stacked bars per stage and, when the trace is given, the Gantt chart of the schedule."""
    figure = Figure(figsize=(13, 9 if trace else 5), layout="constrained")
    if trace:
        bars, gantt = figure.subplots(2, 1, height_ratios=(1, 1.2))
    else:
        bars, gantt = figure.subplots(1, 1), None
    par, totals = report["parallelism"], report["totals"]
    figure.suptitle(f"FLOPs profile of step {report['step']}: pp {par['pipeline_parallel_size']} x tp "
                    f"{par['tensor_parallel_size']} x dp {par['data_parallel_size']}, {par['micro_batches']} "
                    f"micro-batches; iteration {totals['iter_latency_s'] * 1e3:.1f} ms, "
                    f"{flops_rate_to_string(totals['tflops_per_gpu'] * 1e12)} per GPU")
    _plot_bars(bars, report)
    if gantt is not None:
        _plot_gantt(gantt, trace)
    return figure


def main(argv=None):
    parser = argparse.ArgumentParser(description="Plot a FLOPs profile report (and its schedule trace) as a PNG.")
    parser.add_argument("report", help="flops_profile_step{N}.json")
    parser.add_argument("-o", "--output", required=True, help="the image to write (PNG, or any format by extension)")
    parser.add_argument("--trace", help="the Chrome trace (default: pipeline_trace_step{N}.json beside the report)")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    trace_path = args.trace or default_trace_path(args.report, report)
    trace = None
    if os.path.exists(trace_path):
        with open(trace_path) as f:
            trace = json.load(f)
    elif args.trace:
        parser.error(f"no trace at {trace_path}")
    else:
        print(f"note: no trace at {trace_path}: plotting the stage bars only", file=sys.stderr)
    plot_profile(report, trace).savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
