"""The fork end to end: pretrain_gpt.py under the deepspeed launcher, several CPU processes over gloo."""
import re

import pytest
import torch

from megatron.core.enums import ModelType
from tests.helpers.flags import PP2_TP2_CKPT, SCHEDULE, layout
from tests.helpers.launch import TORCHRUN, explain, run_pretrain
from tests.helpers.upstream_checkpoint import write_upstream_checkpoint

pytestmark = pytest.mark.launch

PP1_TP1, PP1_TP2, PP2_TP1 = layout(pp=1, tp=1), layout(pp=1, tp=2), layout(pp=2, tp=1)
# Every layout: 4 micro-batches of 2 (data-parallel size 1), the same seed, data order and schedule.


@pytest.fixture(scope="module")
def pp2_tp1_straight(tmp_path_factory):
    """10 uninterrupted pp2 x tp1 iterations, saving at 5 and 10: a layout run and the resume reference."""
    tmp = tmp_path_factory.mktemp("pp2_tp1")
    flags = PP2_TP1 + SCHEDULE + ["--train-iters", "10", "--save", tmp / "ckpt", "--save-interval", "5"]
    process, losses = run_pretrain(tmp, 2, flags, name="straight", via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    return tmp / "ckpt", losses


@pytest.fixture(scope="module")
def layout_losses(tmp_path_factory, pp2_tp1_straight, pp2_tp2_plain_run):
    """The first five iterations on each layout (pp2 x tp2 with activation checkpointing, which
    recomputes the same values)."""
    losses = {"pp2_tp1": pp2_tp1_straight[1], "pp2_tp2": pp2_tp2_plain_run[1]}
    for name, nprocs, flags in (("pp1_tp1", 1, PP1_TP1), ("pp1_tp2", 2, PP1_TP2)):
        tmp = tmp_path_factory.mktemp(name)
        process, losses[name] = run_pretrain(tmp, nprocs, flags + SCHEDULE + ["--train-iters", "5"], name=name,
                                             via=TORCHRUN)
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
    for key in ("args", "checkpoint_version", "iteration", "tokens", "rng_state", "lr_scheduler"):
        assert key in state, key
    # Upstream's RNG layout: a list with one dict (one per data-parallel rank only with
    # --data-parallel-random-init, refused here); the CPU's generator stands in for CUDA's, as upstream's.
    assert isinstance(state["rng_state"], list) and len(state["rng_state"]) == 1
    assert list(state["rng_state"][0]) == ["random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
                                           "rng_tracker_states"]
    assert state["rng_state"][0]["rng_tracker_states"]  # upstream refuses an empty one
    assert state["args"].model_type is ModelType.encoder_or_decoder
    # Upstream unpickles args with its own megatron package: no value of a class only this fork has.
    modules = {type(value).__module__ for value in vars(state["args"]).values()}
    assert {module for module in modules if module != "builtins" and not module.startswith(("torch", "megatron.core."))
            } == set(), modules
    # No torch Adam/AdamW switch in the groups (it would turn upstream's CPU Adam into AdamW on resume).
    groups = state["optimizer"]["param_groups"]
    assert [group["name"] for group in groups] == ["wd_no_scale_lr", "no_wd_no_scale_lr"]
    assert all("decoupled_weight_decay" not in group for group in groups)
    assert (state["iteration"], state["checkpoint_version"]) == (10, 3.0)
    micro_batches = 8  # 4 micro-batches of 2
    assert state["args"].consumed_train_samples == 10 * micro_batches
    assert state["tokens"] == 10 * micro_batches * state["args"].seq_length
    assert state["lr_scheduler"]["num_steps"] == 10 * micro_batches


def test_upstream_written_checkpoint_resumes_with_no_flag(tmp_path, pp2_tp1_straight):
    """Iteration 5 rewritten in upstream's client-state format (tests/helpers/upstream_checkpoint.py): the
    resumed run is bitwise the uninterrupted one. Weight decay is on (0.01), so the saved groups' torch-Adam
    switch would show if it replaced this run's AdamW."""
    checkpoints, straight_losses = pp2_tp1_straight
    write_upstream_checkpoint(checkpoints, tmp_path / "upstream_ckpt", 5)
    flags = PP2_TP1 + SCHEDULE + ["--train-iters", "10", "--load", tmp_path / "upstream_ckpt"]
    resumed, resumed_losses = run_pretrain(tmp_path, 2, flags, name="from_upstream", via=TORCHRUN)
    assert resumed.returncode == 0, explain(resumed)
    assert resumed_losses == {i: straight_losses[i] for i in range(6, 11)}


@pytest.fixture(scope="module")
def tp2_pp2_resumed_partitioned(tmp_path_factory, pp2_tp2_run_dir, pp2_tp2_plain_run):
    """Iterations 11-20 of the pp2 x tp2 run, resumed from its iteration-10 checkpoint rewritten in upstream's
    format, with --partition-activations (one launch for the two tests below)."""
    tmp = tmp_path_factory.mktemp("tp2_pp2_resumed")
    write_upstream_checkpoint(pp2_tp2_run_dir / "ckpt", tmp / "upstream_ckpt", 10)
    flags = PP2_TP2_CKPT + ["--load", tmp / "upstream_ckpt", "--partition-activations"]
    process, losses = run_pretrain(tmp, 4, flags, name="from_upstream", via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    return process, losses


def test_upstream_written_tp2_pp2_checkpoint_resumes_with_no_flag(tp2_pp2_resumed_partitioned, pp2_tp2_plain_run):
    """The same on tp 2 x pp 2 (four mp_rank files, each its own RNG tracker state), from iteration 10 (the run
    also partitions its activations, which changes no bit: the test below)."""
    _, plain_losses = pp2_tp2_plain_run
    _, resumed_losses = tp2_pp2_resumed_partitioned
    assert resumed_losses == {i: plain_losses[i] for i in range(11, 21)}


def test_partitioned_activations_reach_deepspeed_and_change_nothing(tp2_pp2_resumed_partitioned, pp2_tp2_plain_run):
    """--partition-activations at tp 2 (the run resumed above): DeepSpeed splits each checkpointed layer input
    over the tensor ranks and gathers it back to recompute: the losses are bitwise the plain run's, which did
    not partition them."""
    _, plain_losses = pp2_tp2_plain_run
    _, losses = tp2_pp2_resumed_partitioned
    assert losses == {i: plain_losses[i] for i in range(11, 21)}


def test_load_tag_resumes_the_named_checkpoint(tmp_path, pp2_tp1_straight):
    """`latest` names global_step10; --load-tag global_step5 resumes there, bitwise the uninterrupted run.
    (A resume through `latest` is bitwise too: from this fork's checkpoint in test_faults.py's kill-while-saving
    test, from upstream's format in the two upstream-written tests above.)"""
    checkpoints, straight_losses = pp2_tp1_straight
    flags = PP2_TP1 + SCHEDULE + ["--train-iters", "10", "--load", checkpoints, "--load-tag", "global_step5"]
    resumed, resumed_losses = run_pretrain(tmp_path, 2, flags, name="tagged", via=TORCHRUN)
    assert resumed.returncode == 0, explain(resumed)
    assert resumed_losses == {i: straight_losses[i] for i in range(6, 11)}


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, pp2_tp1_straight):
    """2 pp2 x tp1 iterations fine-tuned from iteration 10 (--finetune), logging --log-num-zeros-in-grad."""
    checkpoints, _ = pp2_tp1_straight
    tmp = tmp_path_factory.mktemp("finetune")
    flags = PP2_TP1 + SCHEDULE + ["--train-iters", "2", "--load", checkpoints, "--finetune", "--log-num-zeros-in-grad"]
    process, losses = run_pretrain(tmp, 2, flags, name="finetune", via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    return process, losses


def test_finetune_loads_the_weights_and_starts_at_iteration_1(finetuned, pp2_tp1_straight):
    """--finetune: the weights of iteration 10, a fresh optimizer and schedule, counted from iteration 0
    (so the first batch is the uninterrupted run's first, now seen by trained weights)."""
    _, straight_losses = pp2_tp1_straight
    process, losses = finetuned
    assert "for fine-tuning, starting at iteration 0" in process.stdout
    assert sorted(losses) == [1, 2] and losses[1] < straight_losses[1] - 0.1, (losses, straight_losses)


def test_num_zeros_in_grad_is_logged(finetuned):
    """--log-num-zeros-in-grad (the fine-tuning run's): upstream's `num zeros` field after `grad norm`, a whole
    count of elements."""
    process, _ = finetuned
    counts = re.findall(r"\| grad norm: [0-9.]+ \| num zeros: ([0-9.]+) \|", process.stdout)
    assert len(counts) == 2 and all(float(count).is_integer() for count in counts), explain(process)


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
