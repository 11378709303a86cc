"""Checkpoints through DeepSpeed's save/load, with Megatron's iteration and data position."""
import torch

from megatron import mpu
from megatron.utils import print_rank_0


def checkpoint_tag(iteration):
    return f"global_step{iteration}"


def _rng_state():
    return {"torch": torch.get_rng_state(), "tensor_parallel": mpu.get_cuda_rng_tracker().get_states()}


def save_checkpoint(engine, save_dir, iteration, consumed_train_samples):
    client_state = {"iteration": iteration, "consumed_train_samples": consumed_train_samples,
                    "rng_state": _rng_state()}
    engine.save_checkpoint(save_dir, tag=checkpoint_tag(iteration), client_state=client_state)
    print_rank_0(f"> saved checkpoint at iteration {iteration} to {save_dir}")


def load_checkpoint(engine, load_dir):
    """Returns (iteration, consumed_train_samples); (0, 0) when load_dir holds no checkpoint yet."""
    load_path, client_state = engine.load_checkpoint(load_dir)
    if load_path is None:
        print_rank_0(f"> no checkpoint found in {load_dir}, training from scratch")
        return 0, 0
    rng = client_state.get("rng_state")
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        mpu.get_cuda_rng_tracker().set_states(rng["tensor_parallel"])
    iteration = client_state["iteration"]
    print_rank_0(f"> loaded checkpoint {load_path} at iteration {iteration}")
    return iteration, client_state["consumed_train_samples"]
