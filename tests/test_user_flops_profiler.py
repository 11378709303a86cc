"""The user's own profiling code, as DeepSpeed's documentation teaches it, on real PipelineEngines over gloo
(tests/scripts/user_flops_profiler.py): FlopsProfiler(model[0]) prints the whole pipeline on one rank, and
no subset of ranks driving the API can leave a collective half-entered. The modes that print no report (the
unprofiled reference and the three partial ones) share one launch, one engine after another."""
import json
import re

import pytest

from patches.profiler.printer import HEADER
from patches.profiler.store_exchange import MIN_WAIT_S
from patches.profiler.tree_merge import aggregate_by_depth
from tests.helpers.flags import PP2_TP2, TINY_GPT
from tests.helpers.golden import assert_report_as_golden, assert_text_as_golden
from tests.helpers.launch import REPO, TORCHRUN, explain, launch
from tests.helpers.tiny_gpt import check_totals

SCRIPT = REPO / "tests" / "scripts" / "user_flops_profiler.py"
WIDTH, MICRO_BATCH, MICRO_BATCHES = 16, 2, 4  # the script's layers and this config
PIPELINE_CONFIG = {"train_batch_size": MICRO_BATCH * MICRO_BATCHES, "train_micro_batch_size_per_gpu": MICRO_BATCH,
                   "steps_per_print": 1000}


def run(out, modes, config=PIPELINE_CONFIG):
    """Launch the script on 2 ranks, `modes` one after another in one launch; returns (process,
    {mode: [each rank's facts]})."""
    config_path = out / "ds.json"
    config_path.write_text(json.dumps(config))
    process = launch(SCRIPT, 2, ["+".join(modes), out, config_path], cwd=out, timeout=240, via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    return process, {mode: [json.loads((out / f"{mode}.rank{r}.json").read_text()) for r in range(2)]
                     for mode in modes}


@pytest.fixture(scope="module")
def unprinted(tmp_path_factory):
    """One launch: the unprofiled reference ("none") first, then "stage0", "unstarted" and "write_error"."""
    return run(tmp_path_factory.mktemp("unprinted"), ["none", "stage0", "unstarted", "write_error"])


def assert_nothing_left_behind(facts):
    for rank_facts in facts:
        before, after = rank_facts["before_profiled_batch"], rank_facts["after_profiled_batch"]
        assert after == before, (before, after)  # no hook, no shadowed method, no flag
        assert after["shadowed"] == [] and after["functional_patched"] is False


@pytest.mark.launch
def test_flops_profiler_of_model_0_prints_the_whole_pipeline_on_one_rank(tmp_path, unprinted):
    """start_profile on every rank, print_model_profile and end_profile on the last stage's rank only; the losses
    are bitwise those of the unprofiled reference (the first engine of the shared launch)."""
    process, by_mode = run(tmp_path, ["every"])
    facts = by_mode["every"]
    output = process.stdout + process.stderr
    assert output.count(HEADER) == 1 and "Profile Summary at step 3:" in output
    report = json.loads((tmp_path / "report.json").read_text())
    linear_fwd = 2 * MICRO_BATCH * WIDTH * WIDTH  # one Linear, one micro-batch, 2 flops per MAC
    totals = report["totals"]
    assert totals["params"] == 2 * (WIDTH * WIDTH + WIDTH)  # both stages' Linear, not one stage's
    assert totals["fwd_flops"] == 2 * MICRO_BATCHES * linear_fwd
    assert totals["recompute_flops"] == totals["fwd_flops"]  # checkpoint interval 1: every Linear re-run once
    assert totals["bwd_flops"] > 0
    assert [s["stage_id"] for s in report["stages"]] == [0, 1]
    assert [child["name"] for child in report["model_tree"]["children"] if child["type"] == "Linear"] == ["0", "2"]
    depth_latency = [sum(row["fwd_latency_s"] + row["bwd_latency_s"] + row["recompute_latency_s"]
                         for row in by_type.values()) for by_type in aggregate_by_depth(report["model_tree"])]
    assert depth_latency == sorted(depth_latency, reverse=True), depth_latency  # inclusive: never grows with depth
    assert "store" in report["collection_note"] and "one host" in report["collection_note"]
    assert_report_as_golden("user", report)  # as this fixed run gave before, times aside
    assert_text_as_golden("user", output)
    printer = facts[1]
    assert printer["is_deepspeed_flops_profiler"] is True
    assert printer["getters"] == [totals["fwd_flops"], totals["fwd_flops"] // 2, totals["params"]]
    assert re.search(r"^depth 1 \(all \d+ modules", output, re.M)  # print_model_aggregated_profile
    assert_nothing_left_behind(facts)
    _, unprofiled = unprinted
    assert [f["losses"] for f in facts] == [f["losses"] for f in unprofiled["none"]]  # bitwise, every iteration


@pytest.mark.launch
def test_a_stage_that_did_not_profile_is_named_within_seconds(unprinted):
    """start_profile and print on stage 0 only: one line names stage 1; nobody waits on it for long (and no
    report is printed by any mode of the launch)."""
    process, by_mode = unprinted
    facts = by_mode["stage0"]
    output = process.stdout + process.stderr
    assert HEADER not in output
    assert ("flops profiler: no whole-pipeline profile of step 3: stage 1 (rank 1) did not profile that train_batch "
            "(call start_profile() on every rank before it)") in output
    assert MIN_WAIT_S <= facts[0]["print_s"] < MIN_WAIT_S + 30
    assert_nothing_left_behind(facts)


@pytest.mark.launch
def test_get_report_where_a_rank_never_started_names_it_on_every_rank(unprinted):
    """PipelineFlopsProfiler (collective by contract) started on rank 0 only: its groups are made in
    get_report, where every rank is, so the rank that never started is named to both, no hang."""
    facts = unprinted[1]["unstarted"]
    assert facts[0]["report_error"].startswith(  # rank 0 is told who failed; rank 1 raises its own error
        "the profile report was not built: rank 1 failed building its profile entry: RuntimeError: "
        "start_profile() never ran on this rank"), facts[0]
    assert facts[1]["report_error"] == "start_profile() never ran on this rank: nothing was measured"
    assert all(len(f["losses"]) == 4 for f in facts)


@pytest.mark.launch
def test_a_report_file_rank_0_cannot_write_fails_on_every_rank_and_training_goes_on(unprinted):
    facts = unprinted[1]["write_error"]
    expected = "the profile report was not written to /proc/no_such_dir/report.json on rank 0: FileNotFoundError"
    assert all(f["write_error"].startswith(expected) for f in facts)
    assert all(len(f["losses"]) == 4 for f in facts)


@pytest.mark.launch
def test_plain_engine_profiled_by_rank_0_alone_reports_locally(tmp_path):
    """The config section on (for a later step); user code drives engine.flops_profiler on rank 0 only, as
    stock DeepSpeed allows: a report of rank 0's own model, no collective."""
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "flops_profiler": {"enabled": True, "profile_step": 100}}
    process, by_mode = run(tmp_path, ["plain"], config)
    facts = by_mode["plain"]
    output = process.stdout + process.stderr
    assert output.count(HEADER) == 1
    assert "global rank 0 of 2 only" in output
    linear_fwd = 2 * MICRO_BATCH * WIDTH * WIDTH
    assert facts[0]["getters"] == [2 * linear_fwd, 2 * (WIDTH * WIDTH + WIDTH)]  # one micro-batch, two Linear
    assert "DeepSpeed Flops Profiler Enabled: True (served by the patches' pipeline-aware profiler)" in output


@pytest.mark.launch
def test_the_users_train_loop_code_on_our_gpt_at_tp2_pp2(tmp_path):
    """The user's report's code in pretrain_gpt.py's train loop (tests/scripts/pretrain_with_user_profiler.py),
    tp 2 x pp 2 with activation checkpointing: the whole model's exact params and FLOPs, printed once."""
    report_path = tmp_path / "user_report.json"
    args = TINY_GPT + PP2_TP2 + ["--train-iters", "3", "--checkpoint-activations"]
    process = launch(REPO / "tests" / "scripts" / "pretrain_with_user_profiler.py", 4, args, cwd=tmp_path,
                     timeout=300, env={"USER_PROFILE_STEP": "2", "USER_PROFILE_JSON": str(report_path)})
    assert process.returncode == 0, explain(process)
    output = process.stdout + process.stderr
    assert output.count(HEADER) == 1 and "Profile Summary at step 2:" in output
    report = json.loads(report_path.read_text())
    check_totals(report, layers=4, sequences=8, checkpointing=True)
    assert [(s["stage_id"], s["global_ranks"]) for s in report["stages"]] == [(0, [0, 1]), (1, [2, 3])]
    # what the run's Megatron arguments say, although the user's code told the profiler none of it
    assert report["parallelism"]["seq_length"] == 16 and report["totals"]["analytic"] is not None
    assert report["totals"]["measured_over_analytic"] is not None
    assert "iteration        3/" in output  # training went on after the profiled iteration
