"""--pp-partition-from-profile in our pretrain_gpt.py: the layers cut where a profile report says, and a checkpoint
of the old partition resumed under the new one (the tiny GPT at pp 2 over gloo, Adam).

The report is a real run's (cut by DeepSpeed's 'parameters', profiled at iteration 2, saved at 2). Its LM head's
measured times are then scaled up 1000 times in a copy, so that the plan is known whatever this machine's
timings were: the head alone on the last stage. Resumed under it, the checkpoint's optimizer state is refused in
one line; with --no-load-optim, the weights move: iteration 3's loss, computed from them alone, is the
uninterrupted run's bitwise, and iteration 4's is not (Adam's moments start afresh)."""
import json

import pytest

from patches.errors import EXIT_BAD_INPUT
from tests.helpers.flags import PP2
from tests.helpers.launch import explain, run_pretrain

SPECS = ["EmbeddingPipe"] + ["ParallelTransformerLayerPipe"] * 4 + ["LayerNorm", "EmbeddingPipe"]
# DeepSpeed's 'parameters': the tied embedding (192 x 32 + 16 x 32 positions) counted on both ends, 12,704 a
# transformer layer, 64 the final norm: [6656, 12704 x 2 | 12704 x 2, 64, 6656] is the most even cut
BY_PARAMETERS, HEAD_ALONE = [0, 3, 7], [0, 6, 7]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("partition_fork")
    flags = PP2 + ["--train-iters", "4", "--save", tmp / "ckpt", "--save-interval", "2",
                   "--pp-partition-method", "parameters", "--profile-flops-step", "2", "--profile-flops-output", tmp]
    process, losses = run_pretrain(tmp, 2, flags, name="saved")
    assert process.returncode == 0, explain(process)
    report = json.loads((tmp / "flops_profile_step2.json").read_text())
    heavy = json.loads(json.dumps(report))
    for field in ("fwd_latency_s", "bwd_latency_s"):
        heavy["layers"][-1][field] *= 1000
    (tmp / "head_heavy.json").write_text(json.dumps(heavy))
    return tmp, report, losses


@pytest.mark.launch
def test_the_report_has_every_layer_and_a_plan(saved):
    _, report, _ = saved
    assert [row["type"] for row in report["layers"]] == SPECS
    assert [row["stage"] for row in report["layers"]] == [0] * 3 + [1] * 4
    assert [row["params"] for row in report["layers"]][1:-1] == [12704] * 4 + [64]
    assert report["partition_plan"]["current_parts"] == BY_PARAMETERS
    # the tied embedding's work is the first layer's on stage 0 and the head's on stage 1
    stages = {stage["stage_id"]: stage for stage in report["stages"]}
    embedding = next(c for c in stages[0]["modules"]["children"] if c["name"] == "tied_modules")
    assert report["layers"][0]["fwd_flops"] == embedding["fwd_flops"]
    assert sum(row["params"] for row in report["layers"]) == sum(stage["params"] for stage in stages.values())


@pytest.mark.launch
def test_a_checkpoint_of_other_parts_resumes_with_no_load_optim(saved):
    tmp, _, uninterrupted = saved
    common = PP2 + ["--train-iters", "4", "--load", tmp / "ckpt", "--load-tag", "global_step2",
                    "--pp-partition-from-profile", tmp / "head_heavy.json"]
    refused, _ = run_pretrain(tmp, 2, common, name="refused")
    assert refused.returncode == EXIT_BAD_INPUT, explain(refused)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: checkpoint global_step2 in {tmp / 'ckpt'} was saved with pipeline parts {BY_PARAMETERS}, "
        f"this run cuts the layers at {HEAD_ALONE}: the weights are saved per layer and move, "
        "the optimizer state is saved per stage and cannot. Resume without it: --no-load-optim (Megatron), or "
        "engine.load_checkpoint(..., load_optimizer_states=False) (DeepSpeed)"]

    process, losses = run_pretrain(tmp, 2, common + ["--no-load-optim"], name="moved")
    assert process.returncode == 0, explain(process)
    assert process.stdout.count(f"> partition_method 'profile' ({tmp / 'head_heavy.json'}): parts {HEAD_ALONE}") == 1
    resumed = f"> checkpoint global_step2: saved with pipeline parts {BY_PARAMETERS}, loaded with parts {HEAD_ALONE}"
    assert process.stdout.count(resumed) == 1
    assert sorted(losses) == [3, 4]
    assert losses[3] == uninterrupted[3]  # the weights, exactly: the same loss, bitwise
    assert losses[4] != uninterrupted[4]  # the optimizer state was not loaded
