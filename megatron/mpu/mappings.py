"""Autograd-aware communication over the tensor-parallel group.

Each function is the identity (in both directions) when the tensor-parallel size is 1. Results are
fresh tensors: the input is never modified in place, so autograd's saved tensors stay intact.
"""
import torch
import torch.distributed as dist

from megatron.mpu.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.mpu.utils import split_tensor_along_last_dim


def _all_reduce(tensor):
    reduced = tensor.clone()
    dist.all_reduce(reduced, group=get_tensor_model_parallel_group())
    return reduced


def _own_slice_of_last_dim(tensor):
    pieces = split_tensor_along_last_dim(tensor, get_tensor_model_parallel_world_size())
    return pieces[get_tensor_model_parallel_rank()].contiguous()


def _all_gather_last_dim(tensor):
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, tensor, group=get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=-1)


def _single_rank():
    return get_tensor_model_parallel_world_size() == 1


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: sum the gradients every tensor rank computed for the input."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Forward: sum the partial results of the tensor ranks. Backward: identity."""

    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dimension. Backward: all-gather it."""

    @staticmethod
    def forward(ctx, x):
        return _own_slice_of_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad)


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dimension. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x):
        return _all_gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice_of_last_dim(grad)


def copy_to_tensor_model_parallel_region(x):
    return x if _single_rank() else _CopyToTensorParallelRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x):
    return x if _single_rank() else _ReduceFromTensorParallelRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x):
    return x if _single_rank() else _ScatterToTensorParallelRegion.apply(x)


def gather_from_tensor_model_parallel_region(x):
    return x if _single_rank() else _GatherFromTensorParallelRegion.apply(x)
