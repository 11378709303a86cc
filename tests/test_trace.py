"""The Chrome trace and the bubble analysis: clock alignment over real gloo processes, DeepSpeed's own
1F1B schedule on ideal hardware (exact), module events of the ModuleProfiler, and the trace of a real
pp=2 x tp=2 pretrain_gpt.py run checked against its JSON report."""
import gc
import json
import os
import time
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

from patches.formats.units import duration_to_string
from patches.process import clean_exit
from patches.profiler.files import validate_report
from patches.profiler.gather import measure_clock_offset
from patches.profiler.module_profiler import ModuleProfiler
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from patches.profiler.trace import FLOW_CATEGORY, INSTRUCTION_CATEGORY, build_trace
from tests.helpers.launch import free_port
from tests.helpers.profiled_runs import PROFILE_STEP, profiled_run
from tests.helpers.schedules import TB, TF, schedule_context, schedule_entries, simulate_1f1b

COMM = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
EPS_US = 1e-3  # float rounding of microsecond timestamps


# ---------------------------------------------------------------- clock alignment on real processes
SHIFTS = {0: 0.0, 1: 12.5, 2: -7.25}  # seconds added to each rank's clock in the second measurement


def _clock_worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        same_clock = measure_clock_offset()
        shifted = measure_clock_offset(clock=lambda: time.perf_counter() + SHIFTS[rank])
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"same": same_clock, "shifted": shifted}, f)
    finally:
        clean_exit.teardown_process_groups()


@pytest.mark.launch
def test_clock_offsets_are_found_within_their_error_bounds(tmp_path):
    """3 processes on one host share perf_counter (true offset 0); then each adds a known shift."""
    mp.spawn(_clock_worker, args=(3, free_port(), str(tmp_path)), nprocs=3)
    results = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)}
    assert results[0] == {"same": [0.0, 0.0], "shifted": [0.0, 0.0]}
    for rank in (1, 2):
        offset, error = results[rank]["same"]
        assert 0 < error < 0.05 and abs(offset) <= error
        offset, error = results[rank]["shifted"]
        assert 0 < error < 0.05 and abs(offset - SHIFTS[rank]) <= error


# ---------------------------------------------------------------- DeepSpeed's 1F1B schedule, ideal hardware
@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (3, 5), (4, 8)])
def test_ideal_1f1b_idles_exactly_the_ideal_bubble(stages, micro_batches):
    """DeepSpeed's schedule on ideal hardware: span (m + p - 1)(tf + tb), every stage idle (p-1)/(m+p-1)."""
    report = build_report(schedule_entries(stages, micro_batches), schedule_context(stages, micro_batches))
    validate_report(report)
    bubble = report["bubble"]
    ideal = (stages - 1) / (micro_batches + stages - 1)
    assert bubble["ideal_fraction"] == ideal
    assert bubble["schedule_span_s"] == (micro_batches + stages - 1) * (TF + TB)
    for row in bubble["stages"]:
        assert row["compute_s"] == micro_batches * (TF + TB)
        assert row["idle_s"] == (stages - 1) * (TF + TB)
        assert row["idle_fraction"] == ideal and row["over_ideal"] == 0.0
    assert bubble["clock_error_s"] == 2.0 ** -20


def test_bubble_names_the_bounding_stage_and_the_wait():
    """The last stage's forward twice as slow: it bounds, the others wait the difference."""
    entries = schedule_entries(2, 4)
    last = next(e for e in entries if e["stage_id"] == 1)
    last["instructions"]["ForwardPass"]["total_s"] *= 2
    report = build_report(entries, schedule_context(2, 4))
    bubble = report["bubble"]
    assert report["bounding_stage"] == bubble["bounding_stage"] == 1
    assert [row["wait_for_bounding_s"] for row in bubble["stages"]] == [4 * TF, 0.0]
    text = format_report(report)
    assert "ideal idle fraction (pp - 1) / (micro-batches + pp - 1) = 20.00%" in text
    assert f"the other stages wait for it {duration_to_string(4 * TF)} per iteration" in text
    # no events (a report built from bare totals): no bubble section
    for e in entries:
        del e["events"]
    bare = build_report(entries, schedule_context(2, 4))
    assert bare["bubble"] is None and "Pipeline bubble" not in format_report(bare)


def test_trace_of_the_schedule_aligns_clocks_labels_and_links():
    """pp=3 x tp=2: ranks' clocks shifted by up to 1000 s land back on one time line."""
    shifts = {1: 1000.25, 2: -3.5, 5: 77.0}
    entries = schedule_entries(3, 4, tp=2, shifts=shifts)
    module_events = {0: [("3.mlp", "MLP", 2, "fwd", 0.25 + 1 / 16, 0.25 + 3 / 16)]}
    trace = build_trace(entries, module_events, step=3)
    json.dumps(trace)  # JSON-ready
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    truth = simulate_1f1b(3, 4)
    for entry in entries:
        mine = [e for e in slices if (e["pid"], e["tid"]) == (entry["stage_id"], entry["tp_rank"])
                and e["cat"] == INSTRUCTION_CATEGORY]
        assert [(e["args"]["instruction"], e["ts"], e["dur"]) for e in mine] == \
            [(name, start * 1e6, (end - start) * 1e6) for name, _, start, end in truth[entry["stage_id"]]]
        forwards = [e for e in mine if e["args"]["instruction"] == "ForwardPass"]
        assert [e["name"] for e in forwards] == [f"ForwardPass mb{k}" for k in range(4)]
        # DeepSpeed keeps max(2, stages - stage_id) buffers, used round robin
        assert [e["args"]["buffer_id"] for e in forwards] == [k % max(2, 3 - entry["stage_id"]) for k in range(4)]
    (module,) = [e for e in slices if e["cat"] == "module.fwd"]
    assert (module["name"], module["pid"], module["tid"], module["args"]["micro_batch"]) == ("3.mlp [fwd]", 0, 0, 1)
    flows = [e for e in trace["traceEvents"] if e.get("cat") == FLOW_CATEGORY]
    assert len(flows) == 2 * (2 * 4 * 2 * 2)  # (activation + gradient) x 4 micro-batches x 2 boundaries x 2 tp
    assert trace["otherData"]["sends_without_receive"] == 0
    assert trace["otherData"]["clock_sync"]["offsets_s"]["1"] == 1000.25


# ---------------------------------------------------------------- module events
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=True)
        return x


def test_module_events_nest_and_add_up_to_the_latencies():
    torch.manual_seed(0)
    net = Net()
    profiler = ModuleProfiler(net)
    # No collection runs: the stretches (wall clock) then add up to the latencies exactly; a collection's pause
    # is in its stretch and out of the latency (tests/test_gc_pauses.py).
    gc.disable()
    try:
        profiler.start()
        for _ in range(2):
            net(torch.randn(4, 8, requires_grad=True)).sum().backward()
        profiler.stop()
    finally:
        gc.enable()
    events = profiler.events()
    profiler.remove()
    assert {phase for *_, phase, _, _ in events} == {"fwd", "bwd", "recompute"}
    paths = {path for path, *_ in events}
    assert paths == {"Net", "blocks", "blocks.0", "blocks.0.fc1", "blocks.0.fc2", "blocks.1", "blocks.1.fc1",
                     "blocks.1.fc2"}
    # stretches from one stack: any two are disjoint or one holds the other
    for _, _, _, _, s1, e1 in events:
        for _, _, _, _, s2, e2 in events:
            assert e1 <= s2 or e2 <= s1 or (s1 <= s2 and e2 <= e1) or (s2 <= s1 and e1 <= e2)
    tree = profiler.tree()
    nodes = {"Net": tree, "blocks.0": tree["children"][0]["children"][0]}
    for path, node in nodes.items():
        for phase in ("fwd", "recompute"):
            wall = sum(end - start for p, _, _, ph, start, end in events if p == path and ph == phase)
            assert wall == pytest.approx(node[f"{phase}_latency_s"], rel=1e-9, abs=1e-12)
    depths = {path: depth for path, _, depth, *_ in events}
    assert depths["Net"] == 0 and depths["blocks.1.fc2"] == 3


# ---------------------------------------------------------------- a real pp=2 x tp=2 run
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return profiled_run(tmp_path_factory, "pp2_tp2_checkpointed")


def _tracks(trace):
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append(e)
    return tracks


@pytest.mark.launch
def test_trace_written_beside_the_report(run):
    assert run.trace_path.parent == run.report_path.parent
    assert run.trace_path.name == f"pipeline_trace_step{PROFILE_STEP}.json"
    trace = run.trace
    names = {(e["name"], e.get("pid"), e.get("tid")): e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"
             and e["name"] in ("process_name", "thread_name")}
    assert names[("process_name", 0, None)] == "stage 0 (ranks 0,1)"
    assert names[("process_name", 1, None)] == "stage 1 (ranks 2,3)"
    assert names[("thread_name", 1, 1)] == "tp 1 (rank 3)"
    assert set(_tracks(trace)) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert trace["otherData"]["step"] == PROFILE_STEP


@pytest.mark.launch
def test_trace_slices_add_up_to_the_report(run):
    """Every stage, every instruction the JSON counts: the count on each tp track, and the largest
    track's total equal to the JSON's (the stage's time is its slowest tp rank's), far within 1%."""
    report, tracks = run.report, _tracks(run.trace)
    for stage in report["stages"]:
        sid = stage["stage_id"]
        for name, instruction in stage["instructions"].items():
            per_track = []
            for tid in range(2):
                mine = [e for e in tracks[(sid, tid)]
                        if e["cat"] == INSTRUCTION_CATEGORY and e["args"]["instruction"] == name]
                assert len(mine) == instruction["count"], (sid, tid, name)
                per_track.append(sum(e["dur"] for e in mine) / 1e6)
            assert max(per_track) == pytest.approx(instruction["total_s"], rel=1e-9), (sid, name)
            assert abs(max(per_track) - instruction["total_s"]) <= 0.01 * instruction["total_s"]
        micro_batches = [e["args"]["micro_batch"] for e in tracks[(sid, 0)]
                         if e["args"].get("instruction") == "BackwardPass"]
        assert micro_batches == [0, 1, 2, 3]


@pytest.mark.launch
def test_every_send_flows_to_its_receive(run):
    trace = run.trace
    tracks = _tracks(trace)
    flows = defaultdict(dict)
    for e in trace["traceEvents"]:
        if e.get("cat") == FLOW_CATEGORY:
            flows[e["id"]][e["ph"]] = e

    def enclosing(event):
        return [s for s in tracks[(event["pid"], event["tid"])] if s["cat"] == INSTRUCTION_CATEGORY
                and s["ts"] <= event["ts"] <= s["ts"] + s["dur"]]

    linked = set()
    for flow in flows.values():
        assert set(flow) == {"s", "f"} and flow["s"]["name"] == flow["f"]["name"] and flow["s"]["bp"] == "e"
        (send,), (recv,) = enclosing(flow["s"]), enclosing(flow["f"])
        expected = {"SendActivation": ("RecvActivation", 1), "SendGrad": ("RecvGrad", -1)}[send["args"]["instruction"]]
        assert (recv["args"]["instruction"], recv["pid"] - send["pid"]) == expected
        assert recv["tid"] == send["tid"] and recv["args"]["micro_batch"] == send["args"]["micro_batch"]
        linked.add((send["pid"], send["tid"], send["ts"]))
    sends = {(e["pid"], e["tid"], e["ts"]) for events in tracks.values() for e in events
             if e.get("args", {}).get("instruction") in ("SendActivation", "SendGrad")}
    assert len(sends) == 2 * 2 * 4 and linked == sends  # each track: 4 sends; every one linked
    assert trace["otherData"]["sends_without_receive"] == 0


@pytest.mark.launch
def test_module_slices_nest_under_their_passes(run):
    report, tracks = run.report, _tracks(run.trace)
    home = {"module.fwd": "ForwardPass", "module.bwd": "BackwardPass", "module.recompute": "BackwardPass"}
    for events in tracks.values():
        passes = [e for e in events if e["cat"] == INSTRUCTION_CATEGORY]
        modules = sorted((e for e in events if e["cat"] in home), key=lambda e: (e["ts"], -e["dur"]))
        assert {e["cat"] for e in modules} == set(home)
        for m in modules:
            (parent,) = [p for p in passes
                         if p["ts"] - EPS_US <= m["ts"] and m["ts"] + m["dur"] <= p["ts"] + p["dur"] + EPS_US]
            assert parent["args"]["instruction"] == home[m["cat"]]
            assert m["args"]["micro_batch"] == parent["args"]["micro_batch"]
        stack = []  # module slices nest among themselves
        for m in modules:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= m["ts"] + EPS_US:
                stack.pop()
            assert not stack or m["ts"] + m["dur"] <= stack[-1]["ts"] + stack[-1]["dur"] + EPS_US
            stack.append(m)
    for stage in report["stages"]:  # the stage module's stretches: its latencies (slowest tp rank)
        root = stage["modules"]
        # A stretch is wall clock, the garbage collector's pauses in it included; a latency leaves them out. So the
        # stretches add up to the latency, plus at most the pauses of the tp rank that paused the longest (exactly
        # the latency where no collection ran).

        def wall(phase, tid, stage_id=stage["stage_id"]):
            return sum(e["dur"] for e in tracks[(stage_id, tid)]
                       if e["cat"] == f"module.{phase}" and e["args"]["depth"] == 0) / 1e6

        def within_pauses(walls, latency, rel, paused=stage["gc"]["pause_s"]):
            assert latency * (1 - rel) <= max(walls) <= (latency + paused) * (1 + rel), (walls, latency, paused)

        within_pauses([wall("fwd", tid) for tid in range(2)], root["fwd_latency_s"], 1e-9)
        within_pauses([wall("recompute", tid) for tid in range(2)], root["recompute_latency_s"], 1e-9)
        # a backward stretch holds the recompute run inside it; the backward latency leaves it out
        within_pauses([wall("bwd", tid) - wall("recompute", tid) for tid in range(2)], root["bwd_latency_s"], 1e-6)


@pytest.mark.launch
def test_clocks_aligned_and_bubble_reported(run):
    report, trace = run.report, run.trace
    sync = trace["otherData"]["clock_sync"]
    assert sync["offsets_s"]["0"] == 0.0 and sync["error_bounds_s"]["0"] == 0.0
    for rank in ("1", "2", "3"):  # one host: every process reads the same clock, the true offset is 0
        assert abs(sync["offsets_s"][rank]) <= sync["error_bounds_s"][rank] < 0.05
    bubble = report["bubble"]
    assert bubble["clock_error_s"] == sync["max_error_s"]
    assert bubble["ideal_fraction"] == 1 / 5  # pp 2, 4 micro-batches
    instructions = [e for events in _tracks(trace).values() for e in events if e["cat"] == INSTRUCTION_CATEGORY]
    start = min(e["ts"] for e in instructions if e["pid"] == 0)
    end = max(e["ts"] + e["dur"] for e in instructions if e["args"]["instruction"] == "BackwardPass")
    assert bubble["schedule_span_s"] == pytest.approx((end - start) / 1e6, rel=1e-9)
    bounding = {s["stage_id"]: s for s in report["stages"]}[report["bounding_stage"]]
    tracks = _tracks(trace)
    for row, stage in zip(bubble["stages"], report["stages"]):
        compute = [sum(e["dur"] for e in tracks[(stage["stage_id"], tid)] if e["cat"] == INSTRUCTION_CATEGORY
                       and e["args"]["instruction"] in ("ForwardPass", "BackwardPass")) / 1e6 for tid in range(2)]
        assert row["compute_s"] == pytest.approx(max(compute), rel=1e-9)  # the busiest tp rank's
        assert row["compute_s"] <= stage["fwd_latency_s"] + stage["bwd_latency_s"]
        assert row["idle_s"] == bubble["schedule_span_s"] - row["compute_s"] > 0
        assert row["idle_fraction"] == row["idle_s"] / bubble["schedule_span_s"]
        assert row["wait_for_bounding_s"] == bounding["busy_s"] - stage["busy_s"] >= 0
    text = run.output
    assert ("Pipeline bubble (1F1B, pp = 2, micro-batches = 4; ideal idle fraction (pp - 1) / (micro-batches + pp - 1) "
            "= 20.00%)") in text
    for row in bubble["stages"]:
        assert f"{100 * row['idle_fraction']:.2f}%" in text
