"""What the profile page shows, taken from one report (and its Chrome trace, where there is one): plain numbers, as
the page's script draws them. Nothing is computed here that the report does not hold, but for sums and the
timeline's rows; the what-if's terms are the planner's (partition/what_if.py).

Each section is None where the report has nothing for it, and `missing` says why in words the page prints.
"""
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from patches.partition.what_if import what_if_model
from patches.profiler.printer import format_report, warning_lines
from patches.profiler.trace import INSTRUCTION_CATEGORY, module_category

RECOMPUTE_SLICES = module_category("recompute")
LAYER_DEPTH = 0  # a module slice at depth 0 is a whole layer of the stage


@dataclass(frozen=True)
class Summary:
    step: int
    world_size: int
    pipeline_parallel_size: int
    tensor_parallel_size: int
    data_parallel_size: int
    micro_batches: int
    micro_batch_size: Optional[int]
    seq_length: Optional[int]
    device: str
    dtype: Optional[str]
    iteration_s: float  # the steady (unprofiled) iteration, or the profiled one where none was measured
    iteration_basis: str
    tflops_per_gpu: Optional[float]
    model_tflops_per_gpu: Optional[float]
    mfu: Optional[float]  # None where the device's peak is not known
    peak_tflops: Optional[float]
    tokens_per_s: Optional[float]
    bounding_stage: Optional[int]
    schedule: Optional[str]
    bubble: Optional[float]  # each stage's idle fraction of the schedule's span, averaged
    ideal_bubble: Optional[float]  # the schedule's: (pp - 1) / (m + pp - 1) for 1F1B
    ideal_name: Optional[str]
    perturbation: Optional[float]  # the profiled iteration over the steady ones


@dataclass(frozen=True)
class Timeline:
    """The profiled iteration of the reported replica, as the trace has it: one row per stage and tensor rank, each
    slice columnar (kind: an index into `kinds`), microseconds from the first instruction."""
    rows: List[str]
    kinds: List[str]
    instructions: Dict[str, list]  # row, kind, micro_batch (-1: none), ts_us, dur_us
    recompute: Dict[str, list]  # row, layer, micro_batch, ts_us, dur_us: each layer's recompute inside a backward


@dataclass(frozen=True)
class StageMemory:
    stage: int
    parts: Dict[str, int]  # what the predicted peak is made of, in the order drawn; they add up to it
    predicted_peak_bytes: int
    measured_peak_bytes: Optional[int]
    measured_at: Optional[str]  # the instruction during which the allocator peaked
    in_flight_micro_batches: int


@dataclass
class PageContent:
    title: str
    summary: Summary
    stages: List[dict]  # per stage: times, FLOPs rate, idle fraction, recompute (the report's words)
    layers: Optional[List[dict]]
    memory: Optional[List[StageMemory]]
    timeline: Optional[Timeline]
    what_if: Optional[dict]
    plan: Optional[dict]  # the report's partition_plan
    read_first: List[str]  # what a reader must not miss: uncounted work, faults, notes of the run
    printed: str  # the report as the profiler prints it
    missing: List[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def page_content(report: dict, trace: Optional[dict], title: str) -> PageContent:
    """The page of `report` (trace: its pipeline_trace_stepN.json, None where there is none)."""
    missing = []
    layers = report.get("layers")
    if not layers:
        missing.append("layer table: none in this report (a plain engine, not a PipelineModule, or a report "
                       "from before it): no layer table and no what-if")
    memory = _memory(report)
    if memory is None:
        missing.append("memory: this report has no stage memory measured (torch's allocator was not read, or a "
                       "report from before it)")
    timeline = _timeline(trace) if trace is not None else None
    if timeline is None:
        missing.append("timeline: no pipeline_trace_stepN.json beside the report (it is written with it)")
    model = what_if_model(report) if layers else None
    if layers and model is None:
        missing.append("what-if: the report has no partition plan (a single stage, or a tied module on one stage)")
    return PageContent(title, _summary(report), _stages(report), layers, memory, timeline,
                       model.as_dict() if model is not None else None, report.get("partition_plan"),
                       _read_first(report), format_report(report, detailed=False), missing)


def _summary(report: dict) -> Summary:
    parallel, totals, device = report["parallelism"], report["totals"], report.get("device") or {}
    bubble = report.get("bubble") or {}
    idle = [row["idle_fraction"] for row in bubble.get("stages") or ()]
    return Summary(
        report["step"], parallel["world_size"], parallel["pipeline_parallel_size"], parallel["tensor_parallel_size"],
        parallel["data_parallel_size"], parallel["micro_batches"], parallel.get("micro_batch_size"),
        parallel.get("seq_length"), device.get("name", "unknown"), device.get("dtype"),
        totals["throughput_iter_s"], totals.get("throughput_basis", "measured"), totals.get("tflops_per_gpu"),
        totals.get("model_tflops_per_gpu"), totals.get("mfu"), totals.get("peak_tflops"), totals.get("tokens_per_s"),
        report.get("bounding_stage"), bubble.get("schedule"), sum(idle) / len(idle) if idle else None,
        bubble.get("ideal_fraction"), bubble.get("ideal_name"), (report.get("perturbation") or {}).get("ratio"))


def _stages(report: dict) -> List[dict]:
    idle = {row["stage_id"]: row for row in (report.get("bubble") or {}).get("stages") or ()}
    layers = report.get("layers") or []
    rows = []
    for stage in report["stages"]:
        sid = stage["stage_id"]
        held = [row for row in layers if row["stage"] == sid]
        rows.append({
            "stage": sid, "ranks": stage.get("global_ranks"), "params_per_gpu": stage.get("params_per_gpu"),
            "fwd_s": stage["fwd_latency_s"], "bwd_s": stage["bwd_latency_s"], "step_s": stage["step_latency_s"],
            "comm_s": stage.get("comm_s"), "other_s": stage.get("other_s"),
            "train_batch_s": stage["train_batch_latency_s"], "tflops_per_gpu": stage.get("tflops_per_gpu"),
            "idle_fraction": (idle.get(sid) or {}).get("idle_fraction"),
            "layers": [row["index"] for row in held],
            "recomputed_layers": [row["index"] for row in held if row["recompute_flops"]],
        })
    return rows


_MEMORY_PARTS = (("base", "base_bytes"), ("parameters", "param_bytes"), ("gradients", "grad_bytes"),
                 ("optimizer state", "optimizer_bytes"))


def _memory(report: dict) -> Optional[List[StageMemory]]:
    stages = []
    for stage in report["stages"]:
        memory = stage.get("memory")
        if not memory or memory.get("predicted_peak_bytes") is None:
            return None
        in_flight = memory["in_flight_micro_batches"]
        parts = {name: memory.get(key) or 0 for name, key in _MEMORY_PARTS}
        if memory["compute_peak_bytes"] >= memory["step_peak_bytes"]:
            parts["layers' activations x in flight"] = in_flight * memory["layer_activation_bytes"]
            parts["outside the layers x in flight"] = in_flight * memory["outside_layers_bytes"]
            transient = "compute transient"
        else:
            transient = "optimizer step transient"
        # the rest of the peak: the transient, on top of what is held (the state as held may differ from the sum of
        # its kinds by what the allocator rounds)
        parts[transient] = memory["predicted_peak_bytes"] - sum(parts.values())
        stages.append(StageMemory(stage["stage_id"], parts, memory["predicted_peak_bytes"],
                                  memory.get("measured_peak_bytes"), memory.get("measured_peak_instruction"),
                                  in_flight))
    return stages


def _timeline(trace: dict) -> Optional[Timeline]:
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not events:
        return None
    names = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            names[event["pid"]] = event["args"]["name"]
    tracks = sorted({(e["pid"], e["tid"]) for e in events if e.get("ph") == "X"})
    rows = [f"{names.get(pid, f'stage {pid}').split(' (')[0]} · tp {tid}" for pid, tid in tracks]
    row_of = {track: row for row, track in enumerate(tracks)}
    kinds: List[str] = []
    instructions, recompute = defaultdict(list), defaultdict(list)
    for event in events:
        if event.get("ph") != "X":
            continue
        args, row = event.get("args") or {}, row_of[event["pid"], event["tid"]]
        if event.get("cat") == INSTRUCTION_CATEGORY:
            if args["instruction"] not in kinds:
                kinds.append(args["instruction"])
            for key, value in (("row", row), ("kind", kinds.index(args["instruction"])),
                               ("micro_batch", args.get("micro_batch", -1)), ("ts_us", event["ts"]),
                               ("dur_us", event["dur"])):
                instructions[key].append(value)
        elif event.get("cat") == RECOMPUTE_SLICES and args.get("depth") == LAYER_DEPTH:
            for key, value in (("row", row), ("layer", args["module"]), ("micro_batch", args.get("micro_batch", -1)),
                               ("ts_us", event["ts"]), ("dur_us", event["dur"])):
                recompute[key].append(value)
    if not instructions:
        return None
    return Timeline(rows, kinds, dict(instructions), dict(recompute))


def _read_first(report: dict) -> List[str]:
    """What the text report prints in its summary and a reader must not miss, one line each."""
    lines = warning_lines(report)
    perturbation = report.get("perturbation") or {}
    for key in ("recompute_note", "collection_note"):
        if report.get(key):
            lines.append(report[key])
    for key in ("baseline_note", "warming_up_note", "log_line_note"):
        if perturbation.get(key):
            lines.append(perturbation[key])
    counting = (report.get("flops_counting") or {}).get("note")
    if counting:
        lines.append(counting)
    return lines
