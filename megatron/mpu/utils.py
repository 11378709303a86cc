"""Small arithmetic helpers for splitting tensors and the vocabulary over tensor-parallel ranks."""
import torch


def divide(numerator, denominator):
    """numerator / denominator as an int; a layout that does not split evenly is a configuration error."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(tensor, num_partitions):
    """Equal views of `tensor` along its last dimension."""
    last_dim_size = divide(tensor.size(-1), num_partitions)
    return torch.split(tensor, last_dim_size, dim=-1)


class VocabUtility:
    """The vocabulary is split in contiguous equal ranges: rank r holds ids [first, last)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank):
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size, rank, world_size):
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank)
