"""megatron.mpu on real gloo process groups: TP=2 layers against the dense model, group layout, RNG.

Each tensor-parallel check runs the TP=2 layer and, in the same process, the dense computation with
plain torch ops on the full master weights (drawn from the same seed), then compares outputs and the
gradients of the input and of every parameter (a rank's shard of a gradient must equal its slice of
the dense gradient).

Tolerance (fp32): atol 1e-6, rtol 1e-5. Splitting a layer over ranks reassociates floating-point
sums (a row-parallel output is the sum of two half-length dot products; gradients of replicated
inputs are summed across ranks), so results may differ from the dense ones by a few ulps of the
summed magnitudes, which are O(1) here (fp32 eps = 1.2e-7, sums of <= 16 terms). A wrong slice, a
missing or doubled all-reduce, or a bias added twice is off by O(0.1).
"""
import json
import os
import time
import traceback
from datetime import timedelta

import deepspeed
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron import clean_exit, mpu
from tests.helpers.launch import free_port

TOLERANCE = dict(atol=1e-6, rtol=1e-5)
SEED = 1234


# ---------------------------------------------------------------------------------------------
# Running a body on N gloo processes; each rank reports {check name: "" or its traceback}.

def _bootstrap(rank, world_size, port, body, out_dir):
    torch.set_num_threads(1)
    # What a launcher sets; then start through DeepSpeed, as megatron.initialize does.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60), verbose=False)
    try:
        results = body()
    finally:
        clean_exit.teardown_process_groups()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _run_on_ranks(body, world_size, out_dir, timeout_s=120):
    context = torch.multiprocessing.start_processes(
        _bootstrap, args=(world_size, free_port(), body, str(out_dir)), nprocs=world_size,
        join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"distributed body {body.__name__} did not finish in {timeout_s} s")
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)}


def _run_checks(checks):
    """Run every check; a failing one is recorded, the others still run (collectives stay in step
    because each check does its communication before it asserts)."""
    results = {}
    for check in checks:
        try:
            check()
            results[check.__name__] = ""
        except Exception:
            results[check.__name__] = traceback.format_exc()
    return results


def _assert_passed(results, name):
    for rank, rank_results in results.items():
        assert rank_results[name] == "", f"rank {rank}:\n{rank_results[name]}"


# ---------------------------------------------------------------------------------------------
# TP=2 layers against the dense model.

def _close(actual, expected):
    torch.testing.assert_close(actual, expected, **TOLERANCE)


def _my_slice(tensor, dim):
    return tensor.chunk(mpu.get_tensor_model_parallel_world_size(), dim=dim)[mpu.get_tensor_model_parallel_rank()]


def _randn(*shape, seed):
    """The same tensor on every rank, whatever the default generator's state."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _master_weight(shape, init_method):
    torch.manual_seed(SEED)
    return init_method(torch.empty(shape))


def _build(layer_class, *args, **kwargs):
    torch.manual_seed(SEED)
    return layer_class(*args, **kwargs)


def _leaf(tensor):
    return tensor.clone().requires_grad_(True)


def _set_bias(layer, full_bias, partition_dim):
    """Biases start at zero; give them values so the forward checks exercise them."""
    assert torch.equal(layer.bias, torch.zeros_like(layer.bias))
    with torch.no_grad():
        layer.bias.copy_(full_bias if partition_dim is None else _my_slice(full_bias, partition_dim))


def _dense_linear(x, weight, bias, grad_output):
    x, weight, bias = _leaf(x), _leaf(weight), _leaf(bias)
    output = F.linear(x, weight, bias)
    output.backward(grad_output)
    return output.detach(), x.grad, weight.grad, bias.grad


def _column_parallel(gather_output):
    init = torch.nn.init.xavier_normal_
    layer = _build(mpu.ColumnParallelLinear, 8, 6, gather_output=gather_output, init_method=init, device="cpu")
    weight, bias, x = _master_weight((6, 8), init), _randn(6, seed=1), _randn(3, 4, 8, seed=2)
    grad_output = _randn(3, 4, 6, seed=3)
    _set_bias(layer, bias, partition_dim=0)
    dense_out, dense_dx, dense_dw, dense_db = _dense_linear(x, weight, bias, grad_output)

    x = _leaf(x)
    out, returned_bias = layer(x)
    out.backward(grad_output if gather_output else _my_slice(grad_output, -1))

    assert returned_bias is None
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    assert layer.bias.tensor_model_parallel and layer.bias.partition_dim == 0
    _close(out, dense_out if gather_output else _my_slice(dense_out, -1))
    _close(x.grad, dense_dx)
    _close(layer.weight.grad, _my_slice(dense_dw, 0))
    _close(layer.bias.grad, _my_slice(dense_db, 0))


def _row_parallel(input_is_parallel):
    init = torch.nn.init.xavier_normal_
    layer = _build(mpu.RowParallelLinear, 8, 6, input_is_parallel=input_is_parallel, init_method=init,
                   device="cpu")
    weight, bias, x = _master_weight((6, 8), init), _randn(6, seed=4), _randn(3, 4, 8, seed=5)
    grad_output = _randn(3, 4, 6, seed=6)
    _set_bias(layer, bias, partition_dim=None)
    dense_out, dense_dx, dense_dw, dense_db = _dense_linear(x, weight, bias, grad_output)

    x = _leaf(_my_slice(x, -1) if input_is_parallel else x)
    out, returned_bias = layer(x)
    out.backward(grad_output)

    assert returned_bias is None
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1
    assert not layer.bias.tensor_model_parallel
    _close(out, dense_out)
    _close(x.grad, _my_slice(dense_dx, -1) if input_is_parallel else dense_dx)
    _close(layer.weight.grad, _my_slice(dense_dw, 1))
    _close(layer.bias.grad, dense_db)


def column_parallel_gather_output():
    _column_parallel(gather_output=True)


def column_parallel_split_output():
    _column_parallel(gather_output=False)


def row_parallel_full_input():
    _row_parallel(input_is_parallel=False)


def row_parallel_split_input():
    _row_parallel(input_is_parallel=True)


def skip_bias_add_returns_the_bias_unadded():
    x = _randn(2, 8, seed=7)
    column = _build(mpu.ColumnParallelLinear, 8, 6, gather_output=False, skip_bias_add=True, device="cpu")
    row = _build(mpu.RowParallelLinear, 6, 8, input_is_parallel=True, skip_bias_add=True, device="cpu")
    _set_bias(column, _randn(6, seed=8), partition_dim=0)
    _set_bias(row, _randn(8, seed=9), partition_dim=None)
    hidden, column_bias = column(x)
    out, row_bias = row(hidden)
    assert column_bias is column.bias and row_bias is row.bias
    _close(hidden, F.linear(x, column.weight))
    dense_hidden = F.linear(x, _master_weight((6, 8), torch.nn.init.xavier_normal_))
    _close(out, F.linear(dense_hidden, _master_weight((8, 6), torch.nn.init.xavier_normal_)))


def vocab_parallel_embedding():
    init = torch.nn.init.xavier_normal_
    # device None: the accelerator's current device, here the CPU.
    layer = _build(mpu.VocabParallelEmbedding, 12, 5, init_method=init)
    weight = _master_weight((12, 5), init)
    # Ids on both ranks' ranges, including each range's first and last id.
    ids = torch.tensor([[0, 5, 6, 11], [3, 3, 9, 7], [11, 0, 2, 8]])
    grad_output = _randn(3, 4, 5, seed=10)
    dense_weight = _leaf(weight)
    dense_out = F.embedding(ids, dense_weight)
    dense_out.backward(grad_output)

    out = layer(ids)
    out.backward(grad_output)

    assert (layer.vocab_start_index, layer.vocab_end_index) == (6 * mpu.get_tensor_model_parallel_rank(),
                                                                6 * mpu.get_tensor_model_parallel_rank() + 6)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    assert layer.weight.device == torch.device("cpu")
    _close(out, dense_out.detach())
    _close(layer.weight.grad, _my_slice(dense_weight.grad, 0))


def vocab_parallel_cross_entropy():
    logits = 3.0 * _randn(3, 4, 12, seed=11)
    logits[0, 0, 7] += 1000.0  # a huge logit: exp() overflows unless the row maximum is subtracted
    logits[1, 2] += 500.0
    target = torch.tensor([[7, 0, 5, 6], [11, 3, 2, 9], [4, 10, 1, 8]])
    grad_loss = _randn(3, 4, seed=12)
    dense_logits = _leaf(logits)
    dense_loss = F.cross_entropy(dense_logits.reshape(-1, 12), target.reshape(-1), reduction="none").reshape(3, 4)
    dense_loss.backward(grad_loss)

    parallel_logits = _leaf(_my_slice(logits, -1))
    loss = mpu.vocab_parallel_cross_entropy(parallel_logits, target)
    loss.backward(grad_loss)

    assert loss.shape == target.shape
    _close(loss, dense_loss.detach())
    _close(parallel_logits.grad, _my_slice(dense_logits.grad, -1))


# ---------------------------------------------------------------------------------------------
# The tensor-parallel RNG (DeepSpeed's tracker) and its replay by DeepSpeed's activation checkpointing.

def _dropout_draws(seed, count):
    """What `count` successive dropouts of ones(1000) give from a generator seeded with `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [F.dropout(torch.ones(1000), 0.5) for _ in range(count)]


def _gather_from_ranks(tensor):
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor)
    return pieces


def rng_fork_differs_across_tensor_ranks():
    mpu.model_parallel_cuda_manual_seed(SEED)
    outside_before = F.dropout(torch.ones(1000), 0.5)
    with mpu.get_cuda_rng_tracker().fork():
        inside = F.dropout(torch.ones(1000), 0.5)
    outside_after = F.dropout(torch.ones(1000), 0.5)
    outside_on_ranks = _gather_from_ranks(outside_before)
    inside_on_ranks = _gather_from_ranks(inside)

    # The default stream is `seed` and forking does not advance it.
    assert [torch.equal(a, b) for a, b in zip([outside_before, outside_after], _dropout_draws(SEED, 2))] == [True] * 2
    # The tensor-parallel stream is `seed + 2718 + tensor rank`.
    assert torch.equal(inside, _dropout_draws(SEED + 2718 + mpu.get_tensor_model_parallel_rank(), 1)[0])
    assert torch.equal(outside_on_ranks[0], outside_on_ranks[1])
    assert not torch.equal(inside_on_ranks[0], inside_on_ranks[1])


def activation_checkpoint_replays_both_rng_streams():
    """DeepSpeed's checkpoint recomputes the forward in backward: the dropout masks (default and
    tensor-parallel streams) must be the ones of the first forward, so gradients are unchanged."""

    def block(x, weight):
        hidden = F.linear(x, weight)
        with mpu.get_cuda_rng_tracker().fork():
            hidden = F.dropout(hidden, 0.5)
        return F.dropout(hidden, 0.5)

    def run(checkpointed):
        mpu.model_parallel_cuda_manual_seed(SEED)
        x, weight = _leaf(_randn(4, 16, seed=13)), _leaf(_randn(16, 16, seed=14))
        out = deepspeed.checkpointing.checkpoint(block, x, weight) if checkpointed else block(x, weight)
        out.sum().backward()
        return out.detach(), x.grad, weight.grad

    plain, recomputed = run(checkpointed=False), run(checkpointed=True)
    assert [torch.equal(a, b) for a, b in zip(plain, recomputed)] == [True] * 3


# ---------------------------------------------------------------------------------------------
# megatron.mpu as DeepSpeed's mpu: a plain DeepSpeedEngine with ZeRO stage 1 over TP=2.

def deepspeed_engine_grad_norm_counts_the_dense_model():
    """The engine's global grad norm is the dense model's: tensor shards summed over the tensor
    group, the replicated row-parallel bias counted once."""
    init = torch.nn.init.xavier_normal_
    model = torch.nn.Sequential(
        _build(mpu.ColumnParallelLinear, 8, 6, gather_output=False, init_method=init, device="cpu"),
        _build(mpu.RowParallelLinear, 6, 8, input_is_parallel=True, init_method=init, device="cpu"))
    _set_bias(model[0], _randn(6, seed=15), partition_dim=0)
    _set_bias(model[1], _randn(8, seed=16), partition_dim=None)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    x, grad_output = _randn(3, 8, seed=17), _randn(3, 8, seed=18)
    hidden, _ = engine.module[0](x)
    out, _ = engine.module[1](hidden)
    engine.backward((out * grad_output).sum())
    engine.step()

    dense = [_leaf(_master_weight((6, 8), init)), _leaf(_randn(6, seed=15)),
             _leaf(_master_weight((8, 6), init)), _leaf(_randn(8, seed=16))]
    (F.linear(F.linear(x, dense[0], dense[1]), dense[2], dense[3]) * grad_output).sum().backward()
    dense_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in dense])).item()

    assert (engine.dp_world_size, engine.mp_world_size) == (1, 2)
    assert abs(engine.get_global_grad_norm() - dense_norm) <= 1e-5 * dense_norm


TP2_CHECKS = [column_parallel_gather_output, column_parallel_split_output, row_parallel_full_input,
              row_parallel_split_input, skip_bias_add_returns_the_bias_unadded, vocab_parallel_embedding,
              vocab_parallel_cross_entropy, rng_fork_differs_across_tensor_ranks,
              activation_checkpoint_replays_both_rng_streams, deepspeed_engine_grad_norm_counts_the_dense_model]


def _tp2_body():
    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    return _run_checks(TP2_CHECKS)


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    return _run_on_ranks(_tp2_body, 2, tmp_path_factory.mktemp("tp2"))


@pytest.mark.launch
@pytest.mark.parametrize("check", [check.__name__ for check in TP2_CHECKS])
def test_tp2(tp2_results, check):
    _assert_passed(tp2_results, check)


# ---------------------------------------------------------------------------------------------
# Group layout on 4 ranks, as DeepSpeed's PipeModelDataParallelTopology numbers them.

def _group_ranks(group):
    return sorted(dist.get_process_group_ranks(group))


def _members_by_all_reduce(group):
    """Sum of 2**rank over the group: checks that the group really communicates among these ranks."""
    mask = torch.tensor([2 ** dist.get_rank()])
    dist.all_reduce(mask, group=group)
    return [r for r in range(dist.get_world_size()) if int(mask) >> r & 1]


def _layout(mpu):
    return {
        "tensor": (_group_ranks(mpu.get_tensor_model_parallel_group()),
                   _members_by_all_reduce(mpu.get_tensor_model_parallel_group()),
                   mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()),
        "pipeline": (_group_ranks(mpu.get_pipeline_model_parallel_group()),
                     _members_by_all_reduce(mpu.get_pipeline_model_parallel_group()),
                     mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()),
        "data": (_group_ranks(mpu.get_data_parallel_group()), _members_by_all_reduce(mpu.get_data_parallel_group()),
                 mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()),
        "deepspeed_model": (_group_ranks(mpu.get_model_parallel_group()), mpu.get_model_parallel_world_size(),
                            mpu.get_model_parallel_rank()),
        "src_rank": mpu.get_tensor_model_parallel_src_rank(),
        "data_group_ranks": mpu.get_data_parallel_group_ranks(),
        "first_last_stage": [mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()],
    }


def _four_rank_body():
    layouts = {}
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=3)
        layouts["tp3_error"] = "no error"
    except ValueError as error:
        layouts["tp3_error"] = str(error)
    layouts["initialized_after_error"] = mpu.model_parallel_is_initialized()
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    layouts["tp2_pp2"] = _layout(mpu)
    layouts["topology_axes"] = mpu.get_topology().get_axis_names()
    mpu.destroy_model_parallel()
    layouts["initialized_after_destroy"] = mpu.model_parallel_is_initialized()
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    layouts["tp1_pp2"] = _layout(mpu)
    return layouts


def _expected_tp2_pp2(rank):
    tensor = [[0, 1], [2, 3]][rank // 2]
    pipeline = [[0, 2], [1, 3]][rank % 2]
    return {"tensor": (tensor, tensor, 2, rank % 2), "pipeline": (pipeline, pipeline, 2, rank // 2),
            "data": ([rank], [rank], 1, 0), "deepspeed_model": (tensor, 2, rank % 2), "src_rank": tensor[0],
            "data_group_ranks": [rank], "first_last_stage": [rank < 2, rank >= 2]}


def _expected_tp1_pp2(rank):
    # Data now varies fastest: data groups {0,1},{2,3}; stages {0,1} and {2,3}.
    data = [[0, 1], [2, 3]][rank // 2]
    pipeline = [[0, 2], [1, 3]][rank % 2]
    return {"tensor": ([rank], [rank], 1, 0), "pipeline": (pipeline, pipeline, 2, rank // 2),
            "data": (data, data, 2, rank % 2), "deepspeed_model": ([rank], 1, 0), "src_rank": rank,
            "data_group_ranks": data, "first_last_stage": [rank < 2, rank >= 2]}


@pytest.mark.launch
def test_group_layout_matches_deepspeed_topology(tmp_path):
    layouts = _run_on_ranks(_four_rank_body, 4, tmp_path)
    for rank, layout in layouts.items():
        # JSON turned tuples into lists.
        expected = json.loads(json.dumps({
            "tp3_error": "world size 4 is not divisible by tensor parallel size 3 x pipeline parallel size 1",
            "initialized_after_error": False, "tp2_pp2": _expected_tp2_pp2(rank),
            "topology_axes": ["pipe", "data", "model"], "initialized_after_destroy": False,
            "tp1_pp2": _expected_tp1_pp2(rank)}))
        assert layout == expected, f"rank {rank}"
