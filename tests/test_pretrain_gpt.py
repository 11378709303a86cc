"""The fork end to end: pretrain_gpt.py under the deepspeed launcher, several CPU processes over gloo."""
import shutil

import pytest

from launch import explain, run_pretrain

LAYOUTS = {  # name: (processes, flags)
    "pp1_tp1": (1, ["--pipeline-model-parallel-size", "1", "--tensor-model-parallel-size", "1"]),
    "pp2_tp1": (2, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1"]),
    "pp1_tp2": (2, ["--pipeline-model-parallel-size", "1", "--tensor-model-parallel-size", "2"]),
    "pp2_tp2": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
}
BATCH = ["--global-batch-size", "8"]  # 4 micro-batches of 2 on every layout (data-parallel size 1)


@pytest.fixture(scope="module")
def layout_losses(tmp_path_factory):
    """Five iterations of the same model, seed and data order on each layout."""
    losses = {}
    for name, (nprocs, flags) in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(name)
        process, losses[name] = run_pretrain(tmp, nprocs, flags + BATCH + ["--train-iters", "5"], name=name)
        assert process.returncode == 0, explain(process)
    return losses


def test_parallel_layouts_compute_the_same_model(layout_losses):
    # fp32 throughout; the layouts differ only in summation order (tensor-parallel all-reduces split
    # each GEMM's reduction in two, pipelines change nothing numerically): measured differences are
    # ~1e-7 relative, so 1e-4 leaves room for Adam amplifying rounding over five steps.
    reference = layout_losses["pp1_tp1"]
    assert sorted(reference) == [1, 2, 3, 4, 5]
    for name, losses in layout_losses.items():
        for iteration, loss in reference.items():
            assert losses[iteration] == pytest.approx(loss, rel=1e-4), (name, iteration)


def test_pp2_tp2_trains_and_loss_goes_down(pp2_tp2_plain_run):
    process, losses = pp2_tp2_plain_run
    assert sorted(losses) == list(range(1, 21))
    first, last = sum(losses[i] for i in (1, 2, 3)) / 3, sum(losses[i] for i in (18, 19, 20)) / 3
    assert last < first - 0.3, losses
    log = process.stdout
    for field in ("iteration       20/      20", "consumed samples:", "elapsed time per iteration (ms):",
                  "learning rate:", "lm loss:", "grad norm:", "tokens per second:", "TFLOPs:"):
        assert field in log, field


def test_resume_matches_uninterrupted_run(tmp_path):
    nprocs, flags = LAYOUTS["pp2_tp1"]
    common = flags + BATCH + ["--train-iters", "10"]
    straight, straight_losses = run_pretrain(
        tmp_path, nprocs, common + ["--save", tmp_path / "ckpt", "--save-interval", "5"], name="straight")
    assert straight.returncode == 0, explain(straight)
    # Keep only the iteration-5 checkpoint, as if the run had stopped there.
    resume_dir = tmp_path / "resume_ckpt"
    shutil.copytree(tmp_path / "ckpt" / "global_step5", resume_dir / "global_step5")
    (resume_dir / "latest").write_text("global_step5")
    resumed, resumed_losses = run_pretrain(tmp_path, nprocs, common + ["--load", resume_dir], name="resumed")
    assert resumed.returncode == 0, explain(resumed)
    assert sorted(resumed_losses) == list(range(6, 11))
    for iteration in range(6, 11):
        assert resumed_losses[iteration] == straight_losses[iteration], iteration
