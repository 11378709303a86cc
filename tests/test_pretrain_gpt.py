"""The fork end to end: pretrain_gpt.py under the deepspeed launcher, several CPU processes over gloo."""
import shutil

import pytest
import torch

from tests.helpers.flags import SCHEDULE, layout
from tests.helpers.launch import explain, run_pretrain

pytestmark = pytest.mark.launch

PP1_TP1, PP1_TP2, PP2_TP1 = layout(pp=1, tp=1), layout(pp=1, tp=2), layout(pp=2, tp=1)
# Every layout: 4 micro-batches of 2 (data-parallel size 1), the same seed, data order and schedule.


@pytest.fixture(scope="module")
def pp2_tp1_straight(tmp_path_factory):
    """10 uninterrupted pp2 x tp1 iterations, saving at 5 and 10: a layout run and the resume reference."""
    tmp = tmp_path_factory.mktemp("pp2_tp1")
    flags = PP2_TP1 + SCHEDULE + ["--train-iters", "10", "--save", tmp / "ckpt", "--save-interval", "5"]
    process, losses = run_pretrain(tmp, 2, flags, name="straight")
    assert process.returncode == 0, explain(process)
    return tmp / "ckpt", losses


@pytest.fixture(scope="module")
def layout_losses(tmp_path_factory, pp2_tp1_straight, pp2_tp2_plain_run):
    """The first five iterations on each layout (pp2 x tp2 with activation checkpointing, which
    recomputes the same values)."""
    losses = {"pp2_tp1": pp2_tp1_straight[1], "pp2_tp2": pp2_tp2_plain_run[1]}
    for name, nprocs, flags in (("pp1_tp1", 1, PP1_TP1), ("pp1_tp2", 2, PP1_TP2)):
        tmp = tmp_path_factory.mktemp(name)
        process, losses[name] = run_pretrain(tmp, nprocs, flags + SCHEDULE + ["--train-iters", "5"], name=name)
        assert process.returncode == 0, explain(process)
    return losses


def test_parallel_layouts_compute_the_same_model(layout_losses):
    # fp32 throughout; the layouts differ only in summation order (tensor-parallel all-reduces split
    # each GEMM's reduction in two, pipelines change nothing numerically): measured differences are
    # ~1e-7 relative, so 1e-4 leaves room for Adam amplifying rounding over five steps.
    reference = layout_losses["pp1_tp1"]
    assert sorted(reference) == [1, 2, 3, 4, 5]
    assert sorted(layout_losses) == ["pp1_tp1", "pp1_tp2", "pp2_tp1", "pp2_tp2"]
    for name, losses in layout_losses.items():
        for iteration, loss in reference.items():
            assert losses[iteration] == pytest.approx(loss, rel=1e-4), (name, iteration)


def test_pp2_tp2_trains_and_loss_goes_down(pp2_tp2_plain_run):
    process, losses = pp2_tp2_plain_run
    assert sorted(losses) == list(range(1, 21))
    first, last = sum(losses[i] for i in (1, 2, 3)) / 3, sum(losses[i] for i in (18, 19, 20)) / 3
    assert last < first - 0.3, losses
    log = process.stdout
    for field in ("iteration       20/      20", "consumed samples:", "consumed tokens:",
                  "elapsed time per iteration (ms):", "learning rate:", "lm loss:", "grad norm:",
                  "tokens per gpu per second (tgs):", "TFLOPs:"):
        assert field in log, field


def test_resume_matches_uninterrupted_run(tmp_path, pp2_tp1_straight):
    checkpoints, straight_losses = pp2_tp1_straight
    # Keep only the iteration-5 checkpoint, as if the run had stopped there.
    resume_dir = tmp_path / "resume_ckpt"
    shutil.copytree(checkpoints / "global_step5", resume_dir / "global_step5")
    (resume_dir / "latest").write_text("global_step5")
    flags = PP2_TP1 + SCHEDULE + ["--train-iters", "10", "--load", resume_dir]
    resumed, resumed_losses = run_pretrain(tmp_path, 2, flags, name="resumed")
    assert resumed.returncode == 0, explain(resumed)
    assert sorted(resumed_losses) == list(range(6, 11))
    for iteration in range(6, 11):
        assert resumed_losses[iteration] == straight_losses[iteration], iteration


def test_checkpoint_has_upstream_layout_and_client_state(pp2_tp1_straight):
    checkpoints, _ = pp2_tp1_straight
    assert (checkpoints / "latest").read_text() == "global_step10"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == "10"
    names = {path.name for path in (checkpoints / "global_step10").iterdir()}
    # Upstream's numbering: its layer 0 is a function (no file); 1 the embedding, 2-5 the transformer
    # layers, 6 the final norm; 7, the LM head, is the tied embedding's forward_fn (saved as layer 1).
    assert {name for name in names if name.startswith("layer_")} == {
        f"layer_{index:02d}-model_00-model_states.pt" for index in range(1, 7)}
    assert "mp_rank_00_model_states.pt" in names
    state = torch.load(checkpoints / "global_step10" / "mp_rank_00_model_states.pt", weights_only=False)
    for key in ("args", "checkpoint_version", "iteration", "tokens", "random_rng_state", "np_rng_state",
                "torch_rng_state", "rng_tracker_states", "lr_scheduler"):
        assert key in state, key
    assert (state["iteration"], state["checkpoint_version"]) == (10, 3.0)
    micro_batches = 8  # 4 micro-batches of 2
    assert state["args"].consumed_train_samples == 10 * micro_batches
    assert state["tokens"] == 10 * micro_batches * state["args"].seq_length
    assert state["lr_scheduler"]["num_steps"] == 10 * micro_batches


def test_checkpoint_of_another_shape_is_refused_in_one_line(tmp_path, pp2_tp1_straight):
    checkpoints, _ = pp2_tp1_straight
    flags = PP2_TP1 + SCHEDULE + ["--num-layers", "8", "--train-iters", "12", "--load", checkpoints]  # saved: 4
    process, _ = run_pretrain(tmp_path, 2, flags, name="wrong")
    output = process.stdout + process.stderr
    assert process.returncode == 2, explain(process)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --load {checkpoints}: the checkpoint has num_layers 4, this run 8: a checkpoint "
                      "loads only into the same model and tensor/pipeline layout"], explain(process)
    assert "Traceback" not in output, explain(process)
