"""Test-only: what unmodified upstream Megatron-DeepSpeed needs to run on CPU (gloo) under DeepSpeed 0.19.6,
a recorder of its exact losses, and torch's own FLOP count of one of its iterations. Not part of the patch set.

Python imports this file at start-up when tests/upstream_shim is on PYTHONPATH (the upstream tier's launches
put it there). Each fix is applied right after the one module it fixes is imported (patches.process.import_hooks),
so a process that never imports that module is untouched; each names its gap.
"""
import functools
import json
import os

from patches.process.import_hooks import after_import


def _cpu_stream_factory(module):
    # DeepSpeed 0.19.6 gap: activation checkpointing calls get_accelerator().Stream(device=...), and the CPU
    # accelerator's Stream is a property returning None ("'NoneType' object is not callable" at the first
    # checkpointed forward). A CPU has no streams and the one made is never used: a callable returning None.
    # (0.19.8 no longer calls it.)
    stream = module.CPU_Accelerator.__dict__.get("Stream")
    if isinstance(stream, property) and stream.fget(None) is None:
        module.CPU_Accelerator.Stream = property(lambda self: lambda *args, **kwargs: None)


def _layernorm_taking_sequence_parallel(module):
    # Upstream 6acc370a gap: off CUDA, megatron.model exports torch.nn.LayerNorm, and GPTModelPipe passes it a
    # `sequence_parallel=` keyword it does not take. A subclass that drops the keyword (same parameters and
    # state-dict keys); current main has its own SPLayerNorm, which takes it, and is left alone.
    import torch

    if module.LayerNorm is torch.nn.LayerNorm:
        class LayerNorm(torch.nn.LayerNorm):
            def __init__(self, *args, sequence_parallel=False, **kwargs):
                super().__init__(*args, **kwargs)

        module.LayerNorm = LayerNorm


def _record_losses(module):
    # Upstream logs losses with 7 significant digits; a bitwise comparison needs them all. The last rank
    # appends {"iteration", "loss_hex"} per train_step to $UPSTREAM_LOSS_RECORD. It only reads the result.
    path = os.environ.get("UPSTREAM_LOSS_RECORD")
    if not path or int(os.environ.get("RANK", "0")) != int(os.environ.get("WORLD_SIZE", "1")) - 1:
        return
    original = module.train_step

    @functools.wraps(original)  # its signature stays upstream's, which patches.to_megatron.megatron_upstream checks
    def train_step(*args, **kwargs):
        result = original(*args, **kwargs)
        from megatron.global_vars import get_args

        loss = next(iter(result[0].values()))
        with open(path, "a") as f:
            f.write(json.dumps({"iteration": get_args().curr_iteration + 1, "loss_hex": float(loss).hex()}) + "\n")
        return result

    module.train_step = train_step


def _count_flops_of_one_iteration(module):
    # The reference count of a plain launch: torch's own FlopCounterMode around train_step at iteration
    # $UPSTREAM_FLOP_COUNT_ITERATION, every rank writing its count to $UPSTREAM_FLOP_COUNT_RECORD.rank<r>.
    path, iteration = os.environ.get("UPSTREAM_FLOP_COUNT_RECORD"), os.environ.get("UPSTREAM_FLOP_COUNT_ITERATION")
    if not path or not iteration:
        return
    original = module.train_step

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        from torch.utils.flop_counter import FlopCounterMode

        from megatron.global_vars import get_args

        if get_args().curr_iteration + 1 != int(iteration):
            return original(*args, **kwargs)
        with FlopCounterMode(display=False) as counter:
            result = original(*args, **kwargs)
        with open(f"{path}.rank{os.environ.get('RANK', '0')}", "w") as f:
            f.write(str(counter.get_total_flops()))
        return result

    module.train_step = train_step


after_import("deepspeed.accelerator.cpu_accelerator", _cpu_stream_factory)
after_import("megatron.model.gpt_model", _layernorm_taking_sequence_parallel)
after_import("megatron.training", _record_losses)
after_import("megatron.training", _count_flops_of_one_iteration)
