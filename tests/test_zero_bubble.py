"""A zero-bubble schedule reported as it ran (tests/scripts/zero_bubble_pipeline.py, 2 stages over gloo).

The schedule splits each backward into BackwardOnlyPass (input gradients, in autograd) and WeightPass (the
weight-gradient GEMMs the linears deferred into WeightGradStore, run outside autograd), as upstream's
--enable-zbh1-pipeline does. The deferred work is backward work: the report's fwd and bwd FLOPs, per module,
equal those of the same model under DeepSpeed's 1F1B, and their sum torch's own count; bwd latency and the
bubble count every backward instruction; the bubble's ideal is the schedule's own, or said to be unknown."""
import json
import os

import pytest

from patches.profiler.instructions import BACKWARD_INSTRUCTIONS
from patches.profiler.printer import HEADER
from patches.profiler.report import build_report
from tests.helpers.contexts import report_context
from tests.helpers.launch import REPO, TORCHRUN, explain, launch
from tests.helpers.schedules import schedule_entries

SCRIPT = REPO / "tests" / "scripts" / "zero_bubble_pipeline.py"
TREE = REPO / "tests" / "zero_bubble_tree"  # where upstream keeps WeightGradStore, written for the test
MICRO_BATCHES, MICRO_BATCH, WIDTH = 4, 2, 16


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both schedules in one launch, 1F1B first, each on an engine of its own."""
    out = tmp_path_factory.mktemp("zero_bubble")
    modes = ("1f1b", "zero_bubble")
    for mode in modes:
        config = {"train_batch_size": MICRO_BATCH * MICRO_BATCHES, "train_micro_batch_size_per_gpu": MICRO_BATCH,
                  "steps_per_print": 1000, "flops_profiler": {"enabled": True, "profile_step": 2, "detailed": True,
                                                              "output_file": str(out / f"{mode}.txt")}}
        (out / f"{mode}_ds.json").write_text(json.dumps(config))
    env = {"PYTHONPATH": os.pathsep.join((str(TREE), str(REPO)))}
    process = launch(SCRIPT, 2, ["+".join(modes), out, out / "{mode}_ds.json"], cwd=out, env=env, timeout=240,
                     via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    results = {}
    for mode in modes:
        results[mode] = json.loads((out / f"{mode}.json").read_text())
        results[mode]["text"] = (out / f"{mode}.txt").read_text()
    return results


def modules(report):
    """{(stage, module name): (fwd, bwd, recompute flops)} of each stage's layers."""
    return {(stage["stage_id"], child["name"]): (child["fwd_flops"], child["bwd_flops"], child["recompute_flops"])
            for stage in report["stages"] for child in stage["modules"]["children"]}


@pytest.mark.launch
def test_deferred_weight_gradients_are_backward_flops_of_their_linears(runs):
    one_f_one_b, zero_bubble = runs["1f1b"]["report"], runs["zero_bubble"]["report"]
    linear = 2 * MICRO_BATCH * WIDTH * WIDTH  # one Linear's GEMM over one micro-batch, 2 FLOPs a multiply-add
    totals = zero_bubble["totals"]
    # forward: 2 linears x 4 micro-batches; backward: each one's weight and input gradients (the script's Function
    # computes the input gradient whether or not it is needed)
    assert (totals["fwd_flops"], totals["bwd_flops"], totals["recompute_flops"]) == (
        2 * MICRO_BATCHES * linear, 4 * MICRO_BATCHES * linear, 0)
    for kind in ("fwd_flops", "bwd_flops", "recompute_flops"):
        assert totals[kind] == one_f_one_b["totals"][kind]
    assert modules(zero_bubble) == modules(one_f_one_b)  # the weight gradients are their linears', not the stage's
    assert zero_bubble["flops_counting"]["calls_differ"] == []  # counted in batch 1, the deferred work included
    for run in runs.values():  # torch's FlopCounterMode around batch 3, summed over the stages
        report_total = run["report"]["totals"]
        assert run["torch_flops"] == report_total["fwd_flops"] + report_total["bwd_flops"]
    assert runs["zero_bubble"]["losses"] == runs["1f1b"]["losses"]  # the same training, bitwise


@pytest.mark.launch
def test_bwd_latency_and_the_bubble_count_every_backward_instruction(runs):
    report, text = runs["zero_bubble"]["report"], runs["zero_bubble"]["text"]
    for stage in report["stages"]:
        instructions = stage["instructions"]
        assert instructions["BackwardOnlyPass"]["count"] == instructions["WeightPass"]["count"] == MICRO_BATCHES
        assert "BackwardPass" not in instructions
        assert stage["bwd_latency_s"] == sum(instructions[name]["total_s"] for name in BACKWARD_INSTRUCTIONS
                                             if name in instructions)
    bubble = report["bubble"]
    assert bubble["schedule"] == "DeferredWeightGradSchedule" and bubble["ideal_fraction"] is None
    assert all(row["over_ideal"] is None for row in bubble["stages"])
    assert text.count(HEADER) == 1
    assert f"bwd latency (BackwardOnlyPass + WeightPass of stage {report['bounding_stage']})" in text
    assert ("Pipeline bubble (schedule DeferredWeightGradSchedule, pp = 2, micro-batches = 4; its ideal idle "
            "fraction is not known to the profiler, so no stage is compared with it)") in text
    one_f_one_b = runs["1f1b"]["report"]["bubble"]
    assert (one_f_one_b["schedule"], one_f_one_b["ideal_fraction"]) == ("TrainSchedule", 1 / 5)


def test_the_bubble_ideal_is_the_schedules_own():
    """Upstream's ZeroBubbleH1Pipeline: (pp - 1) / (3 m + pp - 1), a third of 1F1B's bubble when F = B = W."""
    from tests.helpers.schedules import schedule_context

    entries = schedule_entries(2, 4)
    for entry in entries:
        entry["schedule"] = "ZeroBubbleH1Pipeline"
    bubble = build_report(entries, schedule_context(2, 4))["bubble"]
    assert (bubble["schedule"], bubble["ideal_name"], bubble["ideal_fraction"]) == ("ZeroBubbleH1Pipeline", "ZB-H1",
                                                                                      1 / 13)
    assert bubble["stages"][0]["over_ideal"] == bubble["stages"][0]["idle_fraction"] - 1 / 13
    plain = build_report(schedule_entries(1, 4), report_context(3, 1, 1, 1, 4, 1))["bubble"]
    assert plain is None or plain["ideal_fraction"] == 0.0  # a plain engine: DeepSpeed's 1F1B order, pp 1
