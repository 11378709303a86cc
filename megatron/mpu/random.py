"""The tensor-parallel RNG: DeepSpeed's tracker, so activation-checkpoint recompute replays it.

Two streams: the default generator, seeded alike on every tensor rank (dropout outside the tensor-
parallel region, where activations are replicated, must agree), and the tracker's tensor-parallel
state, seeded `seed + 2718 + tensor rank` (dropout on split activations, e.g. attention heads, must
differ). DeepSpeed's `checkpoint` saves the tracker's states before a chunk's forward and restores
them for its recompute, which is why this delegates to DeepSpeed rather than keeping its own.
"""
import deepspeed
import torch

from megatron.mpu import parallel_state

get_cuda_rng_tracker = deepspeed.checkpointing.get_cuda_rng_tracker


def model_parallel_cuda_manual_seed(seed):
    """Seed the default generators (CPU and accelerator) with `seed` and the tracker per tensor rank."""
    if not deepspeed.checkpointing.is_configured():
        deepspeed.checkpointing.configure(mpu_=parallel_state)
    elif deepspeed.checkpointing.mpu is None:
        raise RuntimeError("deepspeed.checkpointing was configured without an mpu; pass mpu_=megatron.mpu "
                           "so the tensor-parallel seed differs across tensor ranks")
    # DeepSpeed seeds only the accelerator's generator; master weights are drawn on the CPU.
    torch.manual_seed(seed)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed)
