"""The profiled iteration as a Chrome trace: the JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open.

Layout, for the reported data-parallel replica (dp rank 0):
- one process per pipeline stage (pid = stage id), one track per tensor-parallel rank (tid = tp rank);
- every schedule instruction as a slice (cat "instruction"), named with its micro-batch
  ("ForwardPass mb2"; args: instruction, micro_batch, buffer_id). Each stage runs its forward passes,
  backward passes, sends and receives in micro-batch order, so the k-th of each is micro-batch k;
- under them, the module slices (cat "module.fwd", "module.bwd", "module.recompute"): each stretch
  during which a module was active in that phase ("3.self_attention [recompute]");
- a flow arrow from each SendActivation (SendGrad) to the RecvActivation (RecvGrad) of the same
  micro-batch on the next (previous) stage, same tensor rank: from the start of the send to the end
  of the receive.

Times are microseconds from the earliest instruction. Each rank's perf_counter is moved onto global
rank 0's by the offset measured when the report was gathered (gather.measure_clock_offset);
otherData.clock_sync holds every offset and its error bound.
"""
import bisect
from collections import defaultdict
from typing import Dict, List

from patches.profiler.notes import CLOCK_SYNC

INSTRUCTION_CATEGORY = "instruction"
FLOW_CATEGORY = "p2p"
MICRO_BATCH_INSTRUCTIONS = ("LoadMicroBatch", "ForwardPass", "BackwardPass", "BackwardOnlyPass", "SendActivation",
                            "RecvActivation", "SendGrad", "RecvGrad")
# Instructions that take turns over one micro-batch sequence: a zero-bubble schedule runs each micro-batch's
# backward as BackwardPass or as BackwardOnlyPass.
SHARED_COUNTER = {"BackwardOnlyPass": "BackwardPass"}
# send -> (stage step to its receiver, the receiving instruction, what travels)
FLOWS = {"SendActivation": (1, "RecvActivation", "activation"), "SendGrad": (-1, "RecvGrad", "gradient")}
CLOCK_SYNC_METHOD = CLOCK_SYNC


def module_category(phase: str) -> str:
    """'fwd' -> 'module.fwd'."""
    return f"module.{phase}"


def _instruction_slices(entry, to_us):
    pid, tid = entry["stage_id"], entry["tp_rank"]
    seen = defaultdict(int)
    slices = []
    for name, kwargs, start, end in entry["events"]:
        args = {"instruction": name, **kwargs}
        label = name
        if name in MICRO_BATCH_INSTRUCTIONS:
            counter = SHARED_COUNTER.get(name, name)
            args["micro_batch"] = seen[counter]
            seen[counter] += 1
            label = f"{name} mb{args['micro_batch']}"
        slices.append({"name": label, "cat": INSTRUCTION_CATEGORY, "ph": "X", "pid": pid, "tid": tid,
                       "ts": to_us(start), "dur": (end - start) * 1e6, "args": args})
    return slices


def _module_slices(entry, events, instructions, to_us):
    """Module slices, each tagged with the micro-batch of the instruction it runs in."""
    pid, tid = entry["stage_id"], entry["tp_rank"]
    starts = [s["ts"] for s in instructions]
    slices = []
    for path, module_type, depth, phase, start, end in events:
        ts = to_us(start)
        args = {"module": path, "type": module_type, "depth": depth, "phase": phase}
        enclosing = bisect.bisect_right(starts, ts) - 1
        if enclosing >= 0 and "micro_batch" in instructions[enclosing]["args"]:
            args["micro_batch"] = instructions[enclosing]["args"]["micro_batch"]
        slices.append({"name": f"{path} [{phase}]", "cat": module_category(phase), "ph": "X",
                       "pid": pid, "tid": tid, "ts": ts, "dur": (end - start) * 1e6, "args": args})
    return slices


def _flows(instructions_by_track):
    """Flow start/finish pairs for every send whose receive is on the trace; and the sends without one."""
    by_key = {}
    for (pid, tid), slices in instructions_by_track.items():
        for s in slices:
            if "micro_batch" in s["args"]:
                by_key[(pid, tid, s["args"]["instruction"], s["args"]["micro_batch"])] = s
    flows, unmatched = [], 0
    for (pid, tid, name, micro_batch), send in sorted(by_key.items()):
        if name not in FLOWS:
            continue
        step, receiver, payload = FLOWS[name]
        recv = by_key.get((pid + step, tid, receiver, micro_batch))
        if recv is None:
            unmatched += 1
            continue
        common = {"name": f"{payload} mb{micro_batch}", "cat": FLOW_CATEGORY, "id": len(flows) // 2, "bp": "e"}
        # One microsecond inside each slice (or its middle), so each end binds to its own slice.
        flows.append(dict(common, ph="s", pid=pid, tid=tid, ts=send["ts"] + min(1.0, send["dur"] / 2)))
        flows.append(dict(common, ph="f", pid=recv["pid"], tid=tid,
                          ts=recv["ts"] + recv["dur"] - min(1.0, recv["dur"] / 2)))
    return flows, unmatched


def _metadata(replica):
    events = []
    for stage_id in sorted({e["stage_id"] for e in replica}):
        ranks = ",".join(str(e["global_rank"]) for e in replica if e["stage_id"] == stage_id)
        events.append({"ph": "M", "name": "process_name", "pid": stage_id,
                       "args": {"name": f"stage {stage_id} (ranks {ranks})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": stage_id, "args": {"sort_index": stage_id}})
    for e in replica:
        pid, tid = e["stage_id"], e["tp_rank"]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": f"tp {tid} (rank {e['global_rank']})"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return events


def build_trace(rank_entries: List[dict], module_events: Dict[int, list], step: int) -> dict:
    """The Chrome trace (a JSON-ready dict) of the gathered entries' replica dp 0.

    rank_entries: every rank's gathered entry (events, clock_offset_s, clock_error_s, coordinates);
    module_events: {global rank: ModuleProfiler.events()} for the replica's ranks (others ignored).
    """
    replica = sorted((e for e in rank_entries if e["dp_rank"] == 0), key=lambda e: (e["stage_id"], e["tp_rank"]))
    origin = min(start - e["clock_offset_s"] for e in replica for _, _, start, _ in e["events"])
    trace_events = _metadata(replica)
    instructions_by_track = {}
    for entry in replica:
        offset = entry["clock_offset_s"]

        def to_us(t, offset=offset):
            return (t - offset - origin) * 1e6

        instructions = _instruction_slices(entry, to_us)
        instructions_by_track[(entry["stage_id"], entry["tp_rank"])] = instructions
        trace_events += instructions
        trace_events += _module_slices(entry, module_events.get(entry["global_rank"], []), instructions, to_us)
    flows, unmatched = _flows(instructions_by_track)
    trace_events += flows
    return {
        "traceEvents": trace_events,
        "displayTimeUnit": "ms",
        "otherData": {
            "step": int(step),
            "replica": "data-parallel rank 0: one process per pipeline stage, one track per tensor-parallel rank",
            "time": "microseconds from the first instruction, on global rank 0's clock",
            "clock_sync": {
                "method": CLOCK_SYNC_METHOD,
                "reference_rank": 0,
                "offsets_s": {str(e["global_rank"]): e["clock_offset_s"] for e in replica},
                "error_bounds_s": {str(e["global_rank"]): e["clock_error_s"] for e in replica},
                "max_error_s": max(e["clock_error_s"] for e in replica),
            },
            "sends_without_receive": unmatched,
        },
    }
