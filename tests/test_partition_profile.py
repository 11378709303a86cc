"""DeepSpeed's partition_method='profile' on a plain PipelineModule (no Megatron), and a checkpoint resumed across
partitions (tests/scripts/profile_partition.py: 6 Linear(64, 64) and one layer 512 times their work, 2 stages over
gloo, Adam).

One run measures the model cut 'uniform' ([0, 4, 7]: the heavy layer shares stage 1 with three others) and saves a
checkpoint; the report's plan moves those three to stage 0; a PipelineModule built with 'profile:REPORT' (or
'profile' and $DS_PIPE_PARTITION_PROFILE) takes exactly those parts; a model of another layer list is refused in
one line. A checkpoint saved under [0, 4, 7] resumes under the plan: the weights exactly, the optimizer state
refused in one line unless left out (then the first loss equals the old partition's own resume, bitwise).
The runs that end well after the measuring one share one launch ("profile", then both resumes that load)."""
import json
import os

import pytest

from patches.process.errors import EXIT_BAD_INPUT
from tests.helpers.launch import REPO, TORCHRUN, explain, launch

SCRIPT = REPO / "tests" / "scripts" / "profile_partition.py"
UNIFORM = [0, 4, 7]
MICRO_BATCH, MICRO_BATCHES, WIDTH, WIDE = 32, 4, 64, 16384
CONFIG = {"train_batch_size": MICRO_BATCH * MICRO_BATCHES, "train_micro_batch_size_per_gpu": MICRO_BATCH,
          "steps_per_print": 1000}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile_partition")
    (out / "ds.json").write_text(json.dumps(CONFIG))
    return out


def run(out, mode, env=None, via_patches_launch=False):
    args = [SCRIPT, mode, out, out / "ds.json"]
    if via_patches_launch:
        return launch("patches.launch", 2, args, cwd=out, env=env, launcher_args=("--module",), timeout=240)
    return launch(SCRIPT, 2, args[1:], cwd=out, env=env, timeout=240, via=TORCHRUN)


def result(out, mode):
    return json.loads((out / f"{mode}.json").read_text())


def section(output, mode):
    """What the script printed while it ran `mode` (global rank 0 marks where each mode starts)."""
    return output.split(f"== mode {mode}\n", 1)[1].split("== mode ", 1)[0]


@pytest.fixture(scope="module")
def measured(out):
    process = run(out, "measure")
    assert process.returncode == 0, explain(process)
    return json.loads((out / "report.json").read_text())


@pytest.mark.launch
def test_the_report_plans_the_heavy_layer_a_stage_of_its_own(measured, out):
    assert result(out, "measure")["parts"] == UNIFORM
    layers = measured["layers"]
    assert [row["type"] for row in layers] == ["Linear"] * 6 + ["Heavy"]
    assert [row["stage"] for row in layers] == [0] * 4 + [1] * 3
    assert [row["params"] for row in layers] == [WIDTH * WIDTH + WIDTH] * 6 + [2 * WIDTH * WIDE + WIDE + WIDTH]
    linear = 2 * MICRO_BATCH * WIDTH * WIDTH * MICRO_BATCHES  # one Linear's GEMMs, 2 FLOPs a multiply-add
    assert [row["fwd_flops"] for row in layers] == [linear] * 6 + [2 * WIDE // WIDTH * linear]
    plan = measured["partition_plan"]
    assert plan["current_parts"] == UNIFORM and plan["current_bounding_stage"] == 1
    assert plan["parts"] == [0, 6, 7]  # the heavy layer outweighs the six others
    assert plan["predicted_iter_s"] < plan["measured_iter_s"]


@pytest.fixture(scope="module")
def planned_and_resumed(measured, out):
    """One launch: "profile" (with $DS_PIPE_PARTITION_PROFILE set), "resume_uniform", "resume_profile_no_optim"."""
    process = run(out, "profile+resume_uniform+resume_profile_no_optim",
                  env={"DS_PIPE_PARTITION_PROFILE": str(out / "report.json")}, via_patches_launch=True)
    assert process.returncode == 0, explain(process)
    return process


@pytest.mark.launch
def test_partition_method_profile_takes_the_reports_plan(measured, planned_and_resumed, out):
    planned = measured["partition_plan"]["parts"]
    assert result(out, "profile") == {"file": planned, "environment": planned}
    line = f"> partition_method 'profile' ({out / 'report.json'}): parts {planned}"
    # one a PipelineModule, on global rank 0 only
    assert section(planned_and_resumed.stdout, "profile").count(line) == 2


@pytest.mark.launch
def test_a_report_of_another_model_is_refused_in_one_line(measured, out):
    process = run(out, "other_model", via_patches_launch=True)
    assert process.returncode == EXIT_BAD_INPUT, explain(process)
    errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the profile report {out / 'report.json'} profiles another model: 7 layers against "
                      "this PipelineModule's 8, the first difference at layer 6 (Heavy there, Linear here)"]
    assert "Traceback" not in process.stderr


@pytest.mark.launch
def test_a_report_missing_on_one_rank_stops_every_rank_in_one_line(measured, out):
    process = run(out, "missing_on_rank_1", via_patches_launch=True)
    assert process.returncode == EXIT_BAD_INPUT, explain(process)
    errors = {line for line in process.stderr.splitlines() if line.startswith("error:")}
    assert errors == {f"error: on rank 1 of 2: the profile report {out / 'missing.json'} cannot be read: No such "
                      "file or directory (every rank must read the same report)"}, explain(process)
    assert "Traceback" not in process.stderr


@pytest.fixture(scope="module")
def resume_refused(measured, out):
    process = run(out, "resume_profile", via_patches_launch=True)
    assert process.returncode == EXIT_BAD_INPUT, explain(process)
    return process


def loaded_params(out, mode):
    sums = {}
    for rank in (0, 1):
        sums.update(json.loads((out / f"{mode}_params_{rank}.json").read_text()))
    return sums


@pytest.mark.launch
def test_a_checkpoint_resumes_under_another_partition_without_its_optimizer_state(planned_and_resumed, out):
    planned = result(out, "resume_profile_no_optim")["parts"]
    assert planned == [0, 6, 7] and result(out, "resume_uniform")["parts"] == UNIFORM
    # the weights move with their layers: every parameter as the old partition's own resume loads it
    assert loaded_params(out, "resume_profile_no_optim") == loaded_params(out, "resume_uniform")
    assert len(loaded_params(out, "resume_uniform")) == 7 * 2 + 2
    same, moved = result(out, "resume_uniform")["losses"], result(out, "resume_profile_no_optim")["losses"]
    assert moved[0] == same[0]  # computed from the loaded weights alone, bitwise
    assert moved[1] != same[1]  # Adam's moments start afresh: the second step differs
    assert same == result(out, "measure")["losses"][2:]  # the old partition's resume is the uninterrupted run
    line = (f"> checkpoint global_step2: saved with pipeline parts {UNIFORM}, loaded with parts {planned}: its "
            "weights move with their layers; its optimizer state, saved per stage, is not loaded and starts afresh")
    assert section(planned_and_resumed.stdout, "resume_profile_no_optim").count(line) == 1
    assert line not in section(planned_and_resumed.stdout, "resume_uniform")


@pytest.mark.launch
def test_the_optimizer_state_of_other_parts_is_refused_in_one_line(resume_refused, out):
    process = resume_refused
    errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: checkpoint global_step2 in {out / 'checkpoint'} was saved with pipeline parts {UNIFORM}, this run "
        "cuts the layers at [0, 6, 7]: the weights are saved per layer and move, the optimizer state is saved per "
        "stage and cannot. Resume without it: --no-load-optim (Megatron), or "
        "engine.load_checkpoint(..., load_optimizer_states=False) (DeepSpeed)"]
    assert "Traceback" not in process.stderr
    assert not os.path.exists(out / "resume_profile.json")
