"""The report's gather (gather.py) and the straggler view (stragglers.py).

In process: the fixed-size samples, the straggler view's exact figures, the gathered form of
build_report (replica 0's entries + every rank's sample) against the all-entries form, the grid
layout. Over real gloo processes: gather_report on pp 2 x tp 2 x dp 2 gives every rank the report
built from all entries, and a rank that fails to build its entry is named to every rank. Under the
deepspeed launcher: a rank slowed in its forward passes is named by the straggler view, and a
rank failing in get_report ends the run with every rank naming it.
"""
import json
import math
import os
import re

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from patches.process import clean_exit
from patches.profiler.entry import RankEntry
from patches.profiler.files import validate_report
from patches.profiler.gather import ReportError, ReportGroups, gather_report
from patches.profiler.layout import EngineLayout
from patches.profiler.measurement import StageMeasurement
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from patches.profiler.stragglers import SAMPLE_BYTES, RankSample
from tests.helpers.flags import TINY_GPT, layout
from tests.helpers.launch import REPO, explain, free_port, launch
from tests.test_profiler_report import DP, PP, TP, make_context, rank_entries, train_batch_s

FAULT_SCRIPT = REPO / "tests" / "scripts" / "pretrain_with_fault.py"


def by_rank():
    return {e["global_rank"]: e for e in rank_entries()}


# ---------------------------------------------------------------- in process
def test_samples_are_fixed_size_and_round_trip_exactly():
    sample = RankSample(5, 1, 0, 1, 0.1 + 0.2, 1 / 3, 2.5, 0.0)
    failed = RankSample(6, 1, 1, 1, float("inf"), 0.0, 0.0, 0.0, failure="RuntimeError: é" + "x" * 500)
    assert len(sample.to_bytes()) == len(failed.to_bytes()) == SAMPLE_BYTES
    assert RankSample.from_bytes(sample.to_bytes()) == sample
    assert RankSample.from_bytes(failed.to_bytes()).failure.startswith("RuntimeError: éxxx")


def test_gathered_form_builds_the_same_report():
    """What rank 0 holds after the gather (replica 0's entries, every rank's sample) gives exactly the
    report built from every rank's entry."""
    entries = rank_entries()
    replica = [e for e in entries if e["dp_rank"] == 0]
    samples = [RankSample.from_entry(e) for e in entries]
    assert build_report(replica, make_context(), samples) == build_report(entries, make_context())
    with pytest.raises(ValueError, match="need one sample from each of the 8 ranks"):
        build_report(replica, make_context(), samples[1:])
    with pytest.raises(ValueError, match="do not cover replica 0's pp x tp grid"):
        build_report(replica[1:], make_context(), samples)


def test_straggler_view_is_exact_and_names_the_slowest_replica():
    report = build_report(rank_entries(), make_context())
    validate_report(report)
    stages = report["stragglers"]["stages"]
    assert [s["stage_id"] for s in stages] == [0, 1] and all(s["replicas"] == DP for s in stages)
    for stage in stages:
        stage_id = stage["stage_id"]
        fast = max(train_batch_s(stage_id, t) for t in range(TP))  # a replica's time: its slowest tp rank's
        # replica dp 1 took 1 s longer on every rank (test_profiler_report's entries)
        assert stage["train_batch_s"] == {"min": fast, "median": (fast + fast + 1.0) / 2, "max": fast + 1.0,
                                          "slowest_dp_rank": 1,
                                          "slowest_ranks": [stage_id * DP * TP + TP + t for t in range(TP)]}
        # equal forward times: the tie goes to the lowest dp rank
        assert stage["fwd_s"]["min"] == stage["fwd_s"]["max"] and stage["fwd_s"]["slowest_dp_rank"] == 0
    text = format_report(report)
    assert "Stragglers (per stage, over the data-parallel replicas" in text
    assert "  0      train_batch  201.42 ms  701.42 ms  1.2 s      dp 1 (ranks 2,3)" in text


def test_layout_finds_every_rank_as_deepspeed_lays_them_out():
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    with_topology = EngineLayout(0, 0, 0, 2, 2, 3, topology)
    without = EngineLayout(0, 0, 0, 2, 2, 3)
    for rank in range(12):
        coord = topology.get_coord(rank)
        assert with_topology.rank_of(coord.pipe, coord.model, coord.data) == rank
        assert without.rank_of(coord.pipe, coord.model, coord.data) == rank
    assert with_topology.replica_ranks == (0, 1, 6, 7) and with_topology.stage_leaders == (0, 6)


def test_an_entry_asked_of_a_measurement_never_started_says_so():
    # get_report() on such a profiler ends in the gather's ReportError, naming the rank with this reason
    measurement = StageMeasurement(engine=None)
    with pytest.raises(RuntimeError, match=r"^start_profile\(\) never ran on this rank: nothing was measured$"):
        measurement.entry()
    assert isinstance(measurement.entry_or_error(), RuntimeError)  # what a collective report is handed


# ---------------------------------------------------------------- gather_report over gloo
FAILING_RANK = 5


def _gather_worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mine = by_rank()[rank]
        here = EngineLayout(mine["stage_id"], mine["tp_rank"], mine["dp_rank"], PP, TP, DP)
        groups = ReportGroups.for_layout(here)

        result = gather_report(here, groups, RankEntry(**mine, events=[]), make_context())
        outcome = {"report": result.report,
                   "replica": None if result.replica_entries is None else len(result.replica_entries)}

        entry = RuntimeError(f"injected fault on rank {rank}") if rank == FAILING_RANK else \
            RankEntry(**mine, events=[])
        try:
            gather_report(here, groups, entry, make_context())
        except ReportError as e:
            outcome["error"] = [str(e), e.failed_ranks]
        except RuntimeError as e:
            outcome["error"] = [f"own: {e}", None]
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(outcome, f)
    finally:
        clean_exit.teardown_process_groups()


@pytest.mark.launch
def test_gather_gives_every_rank_the_report_and_names_a_failed_rank(tmp_path):
    world = PP * TP * DP
    mp.spawn(_gather_worker, args=(world, free_port(), str(tmp_path)), nprocs=world)
    outcomes = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)}
    # No events in these entries: no clock alignment shows in the report, which is exactly the
    # report of every entry.
    expected = json.loads(json.dumps(build_report(rank_entries(), make_context())))
    for rank, outcome in outcomes.items():
        assert outcome["report"] == expected, rank
        assert outcome["replica"] == (PP * TP if rank == 0 else None)
        if rank == FAILING_RANK:
            assert outcome["error"] == [f"own: injected fault on rank {FAILING_RANK}", None]
        else:
            assert outcome["error"] == [f"the profile report was not built: rank {FAILING_RANK} failed building "
                                        f"its profile entry: RuntimeError: injected fault on rank {FAILING_RANK}",
                                        [FAILING_RANK]]


# ---------------------------------------------------------------- pretrain_gpt.py, dp 2 x pp 2
def _fault_run(tmp_path, at, extra_env=None):
    flags = TINY_GPT + layout(pp=2) + ["--global-batch-size", "8", "--train-iters", "2", "--profile-flops-step", "2",
                                       "--profile-flops-output", tmp_path / "profile"]
    env = {"FAULT_RANK": "3", "FAULT_ITERATION": "2", "FAULT_AT": at, "MEGATRON_DIST_TIMEOUT_S": "60"}
    env.update(extra_env or {})
    return launch(FAULT_SCRIPT, 4, flags, cwd=tmp_path, timeout=300, env=env)


@pytest.mark.launch
def test_a_rank_slowed_in_its_forward_is_named_by_the_straggler_view(tmp_path):
    """Rank 3 (stage 1, dp rank 1) sleeps 0.25 s in each of its 2 forward passes of the profiled iteration."""
    process = _fault_run(tmp_path, "slow")
    assert process.returncode == 0, explain(process)
    report = json.loads((tmp_path / "profile" / "flops_profile_step2.json").read_text())
    validate_report(report)
    fwd = report["stragglers"]["stages"][1]["fwd_s"]
    assert fwd["slowest_dp_rank"] == 1 and fwd["slowest_ranks"] == [3], fwd
    # the sleeps are inside its timed ForwardPass instructions; the other replica's forward takes milliseconds
    assert fwd["max"] >= 2 * 0.25 and fwd["min"] < 0.5 * fwd["max"], fwd
    assert report["stragglers"]["stages"][0]["fwd_s"]["max"] < fwd["max"]
    rows = [line.split() for line in process.stdout.splitlines() if line.startswith("  1      fwd ")]
    assert len(rows) == 1 and rows[0][-3:] == ["1", "(ranks", "3)"], process.stdout


@pytest.mark.launch
def test_a_rank_failing_in_its_report_entry_costs_the_report_not_the_run(tmp_path):
    """Rank 3 raises while building its entry: the profiler's failure. Every rank learns it from the gather, so
    every rank goes on alike: no report, one warning line from rank 0 naming rank 3 and why, exit 0."""
    process = _fault_run(tmp_path, "entry")
    output = process.stdout + process.stderr
    assert process.returncode == 0, explain(process)
    said = re.findall(r"warning: FLOPs profiler: .*?(?=warning: |\n|$)", output)
    assert said == ["warning: FLOPs profiler: no report of iteration 2: the profile report was not built: rank 3 "
                    "failed building its profile entry: RuntimeError: injected fault on rank 3; training goes on"], \
        output
    assert re.search(r"iteration\s+2/\s+2 \|", process.stdout), output  # the profiled iteration ran and logged
    assert not (tmp_path / "profile" / "flops_profile_step2.json").exists()
    assert "error: rank" not in output and "Traceback" not in output


def test_a_failed_rank_is_named_the_same_way_on_both_paths():
    """gather_report and the user-code profiler's publication name a failed rank with one constructor: no
    timings, the error's type and first line."""
    sample = RankSample.failed(5, 1, 0, 2, ValueError("the first line\nand a traceback"))
    assert sample.failure == "ValueError: the first line"
    assert (sample.global_rank, sample.stage_id, sample.tp_rank, sample.dp_rank) == (5, 1, 0, 2)
    assert all(math.isnan(value) for value in (sample.train_batch_s, sample.fwd_s, sample.bwd_s, sample.comm_s))
    assert RankSample.from_bytes(sample.to_bytes()).failure == sample.failure
