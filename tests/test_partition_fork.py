"""--pp-partition-from-profile in our pretrain_gpt.py: the layers cut where a profile report says, and a checkpoint
of the old partition resumed under the new one (the tiny GPT at pp 2 over gloo, Adam under ZeRO stage 1).

The report is a real run's (cut by DeepSpeed's 'parameters', profiled at iteration 2, saved at 2: the session's
shared run profiled_runs "pp2_tp1_zero1", which test_compare_profiles.py compares too). One layer's
measured times are then scaled up 1000 times in a copy, so that the plan is known whatever this machine's
timings were: that layer on a stage with as few others as can be. Resumed under it, the checkpoint's optimizer
state is refused in one line; with --no-load-optim, the weights move: iteration 3's loss, computed from them
alone, is the uninterrupted run's bitwise, and iteration 4's is not (Adam's moments start afresh)."""
import json

import pytest

from patches.formats.units import bytes_to_string, parse_size
from patches.partition.memory_model import memory_terms_of, predict_peaks
from patches.partition.plan_lines import no_fit_line, plan_line
from patches.partition.report_plan import PlanRequest, plan_of
from patches.process.errors import EXIT_BAD_INPUT
from tests.helpers.flags import PP2
from tests.helpers.launch import TORCHRUN, explain, run_pretrain
from tests.helpers.profiled_runs import MEMORY_LIMIT, PROFILE_STEP, profiled_run

SPECS = ["EmbeddingPipe"] + ["ParallelTransformerLayerPipe"] * 4 + ["LayerNorm", "EmbeddingPipe"]
# DeepSpeed's 'parameters': the tied embedding (192 x 32 + 16 x 32 positions) counted on both ends, 12,704 a
# transformer layer, 64 the final norm: [6656, 12704 x 2 | 12704 x 2, 64, 6656] is the most even cut
BY_PARAMETERS, FIRST_LAYER_ALONE, HEAD_ALONE = [0, 3, 7], [0, 2, 7], [0, 6, 7]
# ZeRO-1: its optimizer state is partitioned per stage too, and DeepSpeed loads it apart from the model states
ZERO1 = ["--zero-stage", "1"]


def heavier(report, index, path):
    """A copy of the report with layer `index`'s measured times 1000 times longer."""
    heavy = json.loads(json.dumps(report))
    for field in ("fwd_latency_s", "bwd_latency_s"):
        heavy["layers"][index][field] *= 1000
    path.write_text(json.dumps(heavy))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, report, losses) of 4 iterations at pp 2 under ZeRO 1, cut by 'parameters', profiled at 2 and
    saved at 2 and 4 in ckpt/."""
    run = profiled_run(tmp_path_factory, "pp2_tp1_zero1")
    assert PROFILE_STEP == 2
    return run.directory, run.report, run.losses


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
def test_the_reports_plan_keeps_every_stage_within_the_memory_limit(saved, tmp_path_factory):
    """The run was given --pp-partition-memory-limit: its report's plan is made under it, each stage's predicted
    peak memory_model's for the planned parts, and the plan the one the planner makes from the report under it."""
    _, report, _ = saved
    plan, limit = report["partition_plan"], parse_size(MEMORY_LIMIT)
    assert (plan["memory_limit_bytes"], plan["memory_limit_source"]) == (limit, "flag"), plan
    layers, positions = memory_terms_of(report)
    peaks = predict_peaks(layers, positions, plan["parts"], report["parallelism"]["micro_batches"])
    assert plan["predicted_peak_bytes"] == [peak.predicted_peak_bytes for peak in peaks], plan
    assert plan["memory_fits"] is True and max(plan["predicted_peak_bytes"]) <= limit, plan
    assert plan_of(report, PlanRequest(limit=limit, limit_source="flag")) == plan
    printed = [line.strip() for line in profiled_run(tmp_path_factory, "pp2_tp1_zero1").output.splitlines()
               if line.strip().startswith("partition: ")]
    assert printed == [plan_line(plan)]
    assert f"predicted of {bytes_to_string(limit)} (flag); with each stage's recompute chosen too: " in printed[0]
    chosen = plan["recompute_plan"]  # the recompute chosen with the partition, under the same limit
    assert chosen["memory_fits"] is True and max(chosen["predicted_peak_bytes"]) <= limit, chosen
    # a limit under the least peak of any partition: the closest, by exactly how much its largest peak exceeds
    least = min(max(plan_of(report, PlanRequest(parts=[0, cut, 7]))["predicted_peak_bytes"]) for cut in range(1, 7))
    tight = plan_of(report, PlanRequest(limit=least - 1000, limit_source="flag"))
    assert tight["memory_fits"] is False and tight["memory_excess_bytes"] == 1000
    assert max(tight["predicted_peak_bytes"]) == least


@pytest.mark.launch
def test_zeros_reduction_buckets_stay_with_each_stage_position(saved):
    """ZeRO-1's reduction buckets (DeepSpeed 0.19: two of reduce_bucket_size = 500M fp32 elements, one its gradient
    hooks make in the first backward, one reduce_gradients adds) are each stage's fixed buffers, none of its state:
    the layers split only the state, and moving a layer moves a few hundred KB, not a slice of 4 GB."""
    _, report, _ = saved
    buckets = 2 * 500_000_000 * 4
    for stage in report["stages"]:
        memory = stage["memory"]
        assert memory["fixed_buffer_bytes"] == buckets, memory
        assert memory["state_bytes"] < 1_000_000 and memory["step_transient_bytes"] > buckets - 1_000_000, memory
        held = [row["state_bytes"] for row in report["layers"] if row["stage"] == stage["stage_id"]]
        assert sum(held) == memory["state_bytes"]
    layers, positions = memory_terms_of(report)
    micro_batches = report["parallelism"]["micro_batches"]
    ran = [peak.predicted_peak_bytes for peak in predict_peaks(layers, positions, BY_PARAMETERS, micro_batches)]
    assert ran == [stage["memory"]["predicted_peak_bytes"] for stage in report["stages"]]
    for cut in range(1, 7):
        peaks = predict_peaks(layers, positions, [0, cut, 7], micro_batches)
        # each stage keeps its buckets: within the state moved (at most 1 MB) of the parts that ran
        assert all(abs(peak.predicted_peak_bytes - before) < 1_000_000 for peak, before in zip(peaks, ran)), cut


@pytest.mark.launch
def test_a_checkpoint_of_other_parts_resumes_with_no_load_optim(saved):
    tmp, report, uninterrupted = saved
    plan = heavier(report, 1, tmp / "first_layer_heavy.json")  # the plan: the first transformer layer alone
    common = PP2 + ZERO1 + ["--train-iters", "4", "--load", tmp / "ckpt", "--load-tag", "global_step2",
                            "--pp-partition-from-profile", plan]
    refused, _ = run_pretrain(tmp, 2, common, name="refused")
    assert refused.returncode == EXIT_BAD_INPUT, explain(refused)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: checkpoint global_step2 in {tmp / 'ckpt'} was saved with pipeline parts {BY_PARAMETERS}, "
        f"this run cuts the layers at {FIRST_LAYER_ALONE}: the weights are saved per layer and move, "
        "the optimizer state is saved per stage and cannot. Resume without it: --no-load-optim (Megatron), or "
        "engine.load_checkpoint(..., load_optimizer_states=False) (DeepSpeed)"]

    process, losses = run_pretrain(tmp, 2, common + ["--no-load-optim"], name="moved", via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    assert process.stdout.count(f"> partition_method 'profile' ({plan}): parts {FIRST_LAYER_ALONE}") == 1
    resumed = (f"> checkpoint global_step2: saved with pipeline parts {BY_PARAMETERS}, loaded with parts "
               f"{FIRST_LAYER_ALONE}")
    assert process.stdout.count(resumed) == 1
    assert sorted(losses) == [3, 4]
    assert losses[3] == uninterrupted[3]  # the weights, exactly (ZeRO's master weights from them): bitwise
    assert losses[4] != uninterrupted[4]  # the optimizer state was not loaded


@pytest.mark.launch
def test_zero_on_a_stage_with_fewer_optimizer_groups_is_refused_not_hung(saved):
    """The LM head alone on stage 1 has matrices only: one optimizer group there, two on stage 0. DeepSpeed's
    ZeRO would hang in the first step; the run stops when the engine is built, in one line."""
    tmp, report, _ = saved
    plan = heavier(report, -1, tmp / "head_heavy.json")
    process, _ = run_pretrain(tmp, 2, PP2 + ZERO1 + ["--train-iters", "1", "--pp-partition-from-profile", plan],
                              name="head_alone")
    assert process.returncode == EXIT_BAD_INPUT, explain(process)
    assert process.stdout.count(f"> partition_method 'profile' ({plan}): parts {HEAD_ALONE}") == 1
    errors = {line for line in process.stderr.splitlines() if line.startswith("error:")}
    assert errors == {
        "error: ZeRO stage 1 on this pipeline would hang in its first step: its stages hold unequal numbers of "
        "optimizer parameter groups (stage 0 2, stage 1 1; DeepSpeed drops an empty group, and ZeRO all-reduces "
        "each group's gradient norm across the stages). Cut the layers so that every stage has parameters of "
        "every group (e.g. not an embedding or an LM head alone), or run without ZeRO"}, explain(process)


@pytest.mark.launch
def test_a_limit_no_partition_fits_warns_once_and_training_goes_on(saved):
    """--pp-partition-memory-limit under the least peak any partition of the report reaches: global rank 0 warns in
    one line by how much the closest partition exceeds it, the run cuts the layers there and trains on (exit 0)."""
    tmp, report, _ = saved
    path = tmp / "as_ran.json"
    path.write_text(json.dumps(report))
    least = min(max(plan_of(report, PlanRequest(parts=[0, cut, 7]))["predicted_peak_bytes"]) for cut in range(1, 7))
    closest = plan_of(report, PlanRequest(limit=least - 1000, limit_source="flag"))
    assert closest["memory_fits"] is False and closest["memory_excess_bytes"] == 1000
    process, losses = run_pretrain(tmp, 2, PP2 + ["--train-iters", "1", "--pp-partition-from-profile", path,
                                                  "--pp-partition-memory-limit", str(least - 1000)],
                                   name="no_fit", via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    assert process.stdout.count(f"> partition_method 'profile' ({path}): parts {closest['parts']}") == 1
    warnings = [line for line in process.stdout.splitlines() if line.startswith("warning: partition_method")]
    assert warnings == [f"warning: partition_method 'profile' ({path}): {no_fit_line(closest)}; training goes on "
                        "with them"], explain(process)
    assert sorted(losses) == [1]
