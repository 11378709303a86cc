"""Tensor-parallel layers: the vocabulary-parallel embedding and the column/row-parallel linears.

Every weight is initialised the same way whatever the tensor-parallel size: the full (master)
weight is drawn on the CPU in float32 from the default generator, which the caller seeds alike on
every rank, and each rank keeps its slice. So a model split over tp ranks computes exactly the
model with tp=1.

Parameters split over tensor ranks carry `tensor_model_parallel = True` and `partition_dim` (the
dimension they are split along); replicated ones carry `tensor_model_parallel = False` and -1.
DeepSpeed's grad-norm code reads that flag (counting replicated parameters on tensor rank 0 only).
"""
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.mpu.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from megatron.mpu.utils import VocabUtility, divide


def _module_device(device):
    return torch.device(get_accelerator().current_device_name() if device is None else device)


def _mark(param, partition_dim):
    """partition_dim None: replicated on every tensor rank."""
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim = -1 if partition_dim is None else partition_dim
    return param


def _sharded_weight(master_shape, partition_dim, init_method, params_dtype, device, stacked_parts=1):
    """This rank's slice of a master weight initialised in full, on the CPU, in float32.

    stacked_parts > 1 (partition_dim 0 only): the master's rows are that many stacked blocks (SwiGLU's
    two halves); the rank takes its slice of each block, in order, so its output holds matching slices.
    """
    master = torch.empty(master_shape, dtype=torch.float32)
    init_method(master)
    if stacked_parts > 1:
        assert partition_dim == 0
        blocks = master.view(stacked_parts, master_shape[0] // stacked_parts, *master_shape[1:])
        size = divide(blocks.shape[1], get_tensor_model_parallel_world_size())
        shard = blocks.narrow(1, get_tensor_model_parallel_rank() * size, size).reshape(-1, *master_shape[1:])
        shard = shard.clone(memory_format=torch.contiguous_format)
        return _mark(torch.nn.Parameter(shard.to(device=device, dtype=params_dtype)), partition_dim)
    size = divide(master_shape[partition_dim], get_tensor_model_parallel_world_size())
    shard = master.narrow(partition_dim, get_tensor_model_parallel_rank() * size, size)
    # clone: keep only the slice's memory, not the whole master's storage.
    shard = shard.clone(memory_format=torch.contiguous_format)
    return _mark(torch.nn.Parameter(shard.to(device=device, dtype=params_dtype)), partition_dim)


def _zero_bias(size, partition_dim, params_dtype, device):
    return _mark(torch.nn.Parameter(torch.zeros(size, dtype=params_dtype, device=device)), partition_dim)


def vocab_parallel_weight(num_embeddings, embedding_dim, init_method, params_dtype=torch.float32, device=None):
    """A [vocab, hidden] weight split over tensor ranks by vocabulary rows, as VocabParallelEmbedding's."""
    return _sharded_weight((num_embeddings, embedding_dim), 0, init_method, params_dtype, _module_device(device))


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding whose vocabulary is split in contiguous equal ranges over the tensor ranks.

    Each rank looks up the ids in its range, writes zeros for the others, and the all-reduce sums
    the one non-zero row each token has across ranks.
    """

    def __init__(self, num_embeddings, embedding_dim, init_method=torch.nn.init.xavier_normal_,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
        self.weight = _sharded_weight((num_embeddings, embedding_dim), 0, init_method, params_dtype,
                                      _module_device(device))

    def forward(self, input_ids):
        if get_tensor_model_parallel_world_size() == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(partial)


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A's output rows split over tensor ranks: weight [output_size / tp, input_size].

    Returns (output, bias): the bias is returned separately, unadded, only with skip_bias_add.
    With gather_output False the output stays split along its last dimension. stacked_parts > 1: the
    output is that many stacked blocks and each rank holds its slice of every block (see _sharded_weight).
    """

    def __init__(self, input_size, output_size, bias=True, gather_output=True,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 params_dtype=torch.float32, device=None, stacked_parts=1):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.output_size_per_partition = divide(output_size, get_tensor_model_parallel_world_size())
        device = _module_device(device)
        self.weight = _sharded_weight((output_size, input_size), 0, init_method, params_dtype, device,
                                      stacked_parts=stacked_parts)
        if bias:
            self.bias = _zero_bias(self.output_size_per_partition, 0, params_dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        x = copy_to_tensor_model_parallel_region(x)
        output = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A's input columns split over tensor ranks: weight [output_size, input_size / tp].

    Each rank multiplies its slice of X; the partial products are all-reduced, then the
    (replicated) bias is added once. Returns (output, bias) like ColumnParallelLinear.
    With input_is_parallel False the full input is given and each rank takes its slice.
    """

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.input_size_per_partition = divide(input_size, get_tensor_model_parallel_world_size())
        device = _module_device(device)
        self.weight = _sharded_weight((output_size, input_size), 1, init_method, params_dtype, device)
        if bias:
            self.bias = _zero_bias(output_size, None, params_dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        output = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight))
        if self.bias is None or self.skip_bias_add:
            return output, self.bias
        return output + self.bias, None
