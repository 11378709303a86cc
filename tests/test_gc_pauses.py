"""The garbage collector's pauses (patches/profiler/gc_pauses.py): out of every module's latency and of the plan's
layer times, counted by themselves, per stage in the report.

Each collection here is run by hand (gc.collect() inside a call) with the automatic ones off, over a heap made
large enough that a full collection takes milliseconds: where it lands is then known, and every figure is
compared with what the same clock reads give."""
import gc

import pytest
import torch
from torch import nn

from patches.partition.table import stage_overheads
from patches.profiler.context import IterationTiming
from patches.profiler.engine_hooks import InstructionTimer
from patches.profiler.gc_pauses import GcPauses, GcSummary
from patches.profiler.module_profiler import ModuleProfiler
from patches.profiler.printed_stages import GC_LABEL
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from patches.profiler.report_timing import plan_basis
from tests.test_profiler_report import make_context, rank_entries


@pytest.fixture
def manual_collections():
    """Automatic collections off, and a heap a full collection takes a few milliseconds over."""
    heap = [[index] for index in range(300_000)]
    gc.disable()
    try:
        yield heap
    finally:
        gc.enable()


class Collecting(nn.Module):
    """A layer that runs a full collection in its forward, as an allocation inside a real layer may set off."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        gc.collect()
        return self.linear(x)


def test_a_collection_is_in_no_module_latency(manual_collections):
    net = nn.Sequential(nn.Linear(8, 8), Collecting())
    callbacks = list(gc.callbacks)
    profiler = ModuleProfiler.started(net)
    assert len(gc.callbacks) == len(callbacks) + 1
    net(torch.randn(4, 8))
    events = profiler.events()
    results = profiler.finish()
    assert gc.callbacks == callbacks  # the watch goes with the measuring
    assert (results.gc.collections, results.gc.generation_2) == (1, 1)
    assert results.gc.pause_s == results.gc.longest_s > 0.001
    collecting = results.tree["children"][1]
    stretch = [end - start for path, *_, start, end in events if path == "1"]
    # the same clock reads: the stretch (wall clock) holds the pause, the latency does not
    assert stretch[0] - results.gc.pause_s == pytest.approx(collecting["fwd_latency_s"], rel=1e-9)
    assert collecting["fwd_latency_s"] < results.gc.pause_s
    root_stretch = [end - start for path, *_, start, end in events if path == "Sequential"]
    assert root_stretch[0] - results.gc.pause_s == pytest.approx(results.tree["fwd_latency_s"], rel=1e-9)


def test_collections_outside_measuring_are_not_counted(manual_collections):
    net = nn.Sequential(Collecting())
    profiler = ModuleProfiler(net)
    net(torch.randn(4, 8))  # before start: not watched
    profiler.start()
    profiler.stop()
    net(torch.randn(4, 8))  # after stop: not watched
    assert profiler.results().gc == GcSummary()
    assert GcPauses().summary == GcSummary()


def test_an_instruction_counts_the_pauses_inside_it(manual_collections):
    pauses = GcPauses()
    timer = InstructionTimer(lambda: None, pauses)
    pauses.watch()
    try:
        timer.run("ForwardPass", gc.collect)
        timer.run("SendActivation", lambda: None)
    finally:
        pauses.unwatch()
    assert timer.paused_in(["ForwardPass"]) == pauses.summary.pause_s > 0
    assert timer.paused_in(["SendActivation", "BackwardPass"]) == 0.0
    assert timer.totals["ForwardPass"] >= pauses.summary.pause_s  # the instruction's own time is what happened


def test_the_plan_leaves_the_pauses_out_of_each_stage_overhead():
    stage = {"stage_id": 0, "fwd_latency_s": 1.0, "bwd_latency_s": 2.0, "gc": {"in_compute_s": 0.25}}
    layers = [{"stage": 0, "fwd_latency_s": 0.5, "bwd_latency_s": 1.0, "recompute_latency_s": 0.0}]
    assert stage_overheads([stage], layers) == [1.25]  # 3.0 of instructions, 1.5 of layers, 0.25 paused
    del stage["gc"]  # a report from before the pauses were measured
    assert stage_overheads([stage], layers) == [1.5]


def test_the_plan_scales_from_the_profiled_iteration_without_its_pauses():
    steady = IterationTiming(2.0, 1.6, [4, 5, 6], unprofiled_spread=0.05)
    assert plan_basis(steady, paused_s=0.4).time_scale == pytest.approx(1.0)  # 1.6 / (2.0 - 0.4)
    assert plan_basis(steady).time_scale == pytest.approx(0.8)


def test_the_report_gives_each_stages_pauses_and_prints_them():
    entries = rank_entries()
    summary = {"collections": 12, "pause_s": 0.2, "longest_s": 0.15, "generation_2": 1, "in_compute_s": 0.15}
    for entry in entries:
        entry["gc"] = dict(summary, pause_s=0.2 if entry["stage_id"] == 0 else 0.01)
    timing = IterationTiming(2.5, 2.0, [4, 5, 6], unprofiled_spread=0.1)
    report = build_report(entries, make_context(timing=timing))
    assert [stage["gc"]["pause_s"] for stage in report["stages"]] == [0.2] + [0.01] * (len(report["stages"]) - 1)
    # the profiled iteration less the most any stage paused: 2.3 s, 1.15x the steady 2.0 s
    assert report["perturbation"]["warming_up_note"].startswith(
        "the profiled iteration took 1.15x the steady unprofiled ones without the garbage collector's 200 ms of "
        "pauses: it was still warming up")
    assert report["perturbation"]["ratio"] == pytest.approx(1.25)  # what happened, pauses included
    printed = [line for line in format_report(report).splitlines() if GC_LABEL in line]
    assert printed == ["  " + GC_LABEL + ": stage 0 200 ms in 12 collections (1 full, the longest 150 ms); "
                       + "; ".join(f"stage {s} 10 ms in 12 collections (1 full, the longest 150 ms)"
                                   for s in range(1, len(report["stages"])))]
