"""Printing from one rank, as Megatron does."""
import torch


def _rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _is_last_rank():
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_rank_0(message):
    if _rank() == 0:
        print(message, flush=True)


def print_rank_last(message):
    """The loss lives on the last pipeline stage, so Megatron's training log comes from the last rank."""
    if _is_last_rank():
        print(message, flush=True)
