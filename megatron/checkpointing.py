"""Checkpoints through DeepSpeed's save/load, with Megatron's iteration and data position, saved atomically.

DeepSpeed writes every rank's files straight into `save_dir/<tag>/`, and global rank 0 writes
`latest` as soon as its own files are done, without waiting for the other ranks: a rank killed while
saving leaves a `latest` naming a checkpoint that lacks that rank's files. Here every rank writes
into `<tag>.incomplete/`; once all ranks are past DeepSpeed's closing barrier, global rank 0 flushes
the files, renames the directory to `<tag>` and only then replaces `latest` (write a temporary file,
rename it). A run killed at any point leaves `latest` naming a complete checkpoint, or the previous
one. The rename is done by global rank 0, so `--save` must be a filesystem every rank sees.

The layout is Megatron-DeepSpeed's: `<save>/global_step<N>/` holds DeepSpeed's files, `latest` names
that tag, `latest_checkpointed_iteration.txt` holds N, and the client state in the model-states files
carries upstream's keys (`args` with `consumed_train_samples` and `model_type`, `checkpoint_version` 3.0,
`iteration`, `tokens`, and `rng_state`: a list of one dict of `random_rng_state`, `np_rng_state`,
`torch_rng_state`, `cuda_rng_state` (the accelerator's generator: the CPU's on a CPU, as upstream) and
`rng_tracker_states`), so either side can resume the other's run. Upstream keeps one list entry per
data-parallel rank only with --data-parallel-random-init, refused here, so entry 0 is every rank's.
A checkpoint of a different model shape or parallel layout is refused with one line naming the first
value that differs.
"""
import argparse
import contextlib
import os
import pickle
import random
import re
import shutil

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.utils import print_rank_0

LATEST_FILE = "latest"
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # upstream's tracker: the iteration as text
CHECKPOINT_VERSION = 3.0
# Values a checkpoint must share with the run that loads it (upstream checks the same ones).
MUST_MATCH = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "padded_vocab_size",
              "tensor_model_parallel_size", "pipeline_model_parallel_size")
INCOMPLETE_SUFFIX = ".incomplete"
VARIANT_FLAG = "decoupled_weight_decay"  # torch's Adam (False) or AdamW (True), per param group
_TAG_PATTERN = re.compile(r"global_step(\d+)")


class CheckpointError(RuntimeError):
    """--load names a checkpoint that is not there."""


def checkpoint_tag(iteration):
    return f"global_step{iteration}"


def read_latest_tag(load_dir):
    """The tag `latest` names, or None when load_dir holds no finished checkpoint."""
    try:
        with open(os.path.join(load_dir, LATEST_FILE)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def latest_iteration(load_dir, load_tag=None):
    """The iteration of the checkpoint --load (and --load-tag) would resume from, or None (none, or not ours)."""
    tag = load_tag or read_latest_tag(load_dir)
    match = _TAG_PATTERN.fullmatch(tag) if tag else None
    return int(match.group(1)) if match else None


def _rng_states():
    """Upstream's `rng_state` value: a list with this rank's generator states (the same keys, same order)."""
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": get_accelerator().get_rng_state(),
             "rng_tracker_states": mpu.get_cuda_rng_tracker().get_states()}]


def _restore_rng_states(client_state, load_dir):
    if "rng_state" in client_state and isinstance(client_state["rng_state"], list):
        states = client_state["rng_state"][0]  # upstream's format, and ours
    elif "torch_rng_state" in client_state:
        states = client_state  # upstream's older top-level keys
    elif "rng_state" in client_state:  # written by earlier versions of this fork
        torch.set_rng_state(client_state["rng_state"]["torch"])
        mpu.get_cuda_rng_tracker().set_states(client_state["rng_state"]["tensor_parallel"])
        return
    else:  # _validate_load refuses this at start; kept for callers that skip it
        raise CheckpointError(f"the checkpoint in {load_dir} has no RNG state: give --no-load-rng")
    random.setstate(states["random_rng_state"])
    np.random.set_state(states["np_rng_state"])
    torch.set_rng_state(states["torch_rng_state"])
    if "cuda_rng_state" in states:
        get_accelerator().set_rng_state(states["cuda_rng_state"])
    mpu.get_cuda_rng_tracker().set_states(states["rng_tracker_states"])


def _picklable_args(args):
    """The run's args as upstream stores them, less values upstream could not unpickle.

    Upstream unpickles `args` with its own `megatron` package: a value of a class of this fork (a
    dataclass of megatron.arguments, an open writer) would stop it. Builtins, torch values and the
    enums of megatron.core (which upstream has too) are kept.
    """
    kept = {}
    for name, value in vars(args).items():
        module = type(value).__module__
        if module != "builtins" and not module.startswith(("torch", "megatron.core.")):
            continue
        try:
            pickle.dumps(value)
        except Exception:
            continue
        kept[name] = value
    return argparse.Namespace(**kept)


def save_checkpoint(engine, save_dir, iteration, args):
    """Collective: every rank calls it. args carries consumed_train_samples and consumed_train_tokens."""
    tag = checkpoint_tag(iteration)
    staging = os.path.join(save_dir, tag + INCOMPLETE_SUFFIX)
    first = torch.distributed.get_rank() == 0
    if first and os.path.isdir(staging):
        shutil.rmtree(staging)  # left by a run killed while saving; DeepSpeed barriers before anyone writes
    client_state = {"args": _picklable_args(args), "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                    "tokens": args.consumed_train_tokens}
    if not args.no_save_rng:
        client_state["rng_state"] = _rng_states()
    # Returns on every rank only after DeepSpeed's closing barrier: all files of all ranks are written.
    with _without_variant_flag(engine):
        engine.save_checkpoint(save_dir, tag=tag + INCOMPLETE_SUFFIX, client_state=client_state, save_latest=False)
    if first:
        _fsync_tree(staging)
        _replace_directory(staging, os.path.join(save_dir, tag))
        _write_file_atomically(os.path.join(save_dir, LATEST_FILE), tag)
        _write_file_atomically(os.path.join(save_dir, TRACKER_FILE), str(iteration))
    torch.distributed.barrier()  # nobody reads `latest` or the directory before it is in place
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}")


def _torch_optimizer(engine):
    """The torch optimizer DeepSpeed steps (inside its fp16/bf16/ZeRO wrappers), or None."""
    optimizer = engine.optimizer
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


@contextlib.contextmanager
def _without_variant_flag(engine):
    """Save the param groups without torch's Adam/AdamW switch, as upstream's (apex) optimizer saves them.

    torch.optim.Adam and AdamW differ only in each group's `decoupled_weight_decay`, and a torch
    optimizer loading a checkpoint takes its groups whole: saved, the flag would turn upstream's CPU
    optimizer (torch Adam) into AdamW on resume. Without it, each side keeps its own algorithm.
    """
    optimizer = _torch_optimizer(engine)
    groups = optimizer.param_groups if optimizer is not None else []
    saved = [group.pop(VARIANT_FLAG, None) for group in groups]
    try:
        yield
    finally:
        for group, value in zip(groups, saved):
            if value is not None:
                group[VARIANT_FLAG] = value


def check_checkpoint_args(saved_args, args):
    """Raise CheckpointError naming the first shape or layout value that differs from the run's."""
    for name in MUST_MATCH:
        if hasattr(saved_args, name) and hasattr(args, name) and getattr(saved_args, name) != getattr(args, name):
            raise CheckpointError(f"the checkpoint has {name} {getattr(saved_args, name)}, this run "
                                  f"{getattr(args, name, None)}: a checkpoint loads only into the same model and "
                                  f"tensor/pipeline layout")


def load_checkpoint(engine, load_dir, args):
    """Returns (iteration, consumed_train_samples, consumed_train_tokens); zeros when load_dir holds none."""
    tag = args.load_tag or read_latest_tag(load_dir)
    if tag is None:
        print_rank_0(f"> no checkpoint found in {load_dir}, training from scratch")
        return 0, 0, 0
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise CheckpointError(f"{os.path.join(load_dir, LATEST_FILE)} names {tag}, which is not in {load_dir}")
    _check_saved_args(load_dir, tag, args)
    if args.finetune:  # upstream's: the weights alone, counted from iteration 0
        load_path, _ = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=False,
                                              load_lr_scheduler_states=False, load_module_only=True)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
        engine.global_steps = 0
        print_rank_0(f"> loaded the weights of {load_path} for fine-tuning, starting at iteration 0")
        return 0, 0, 0
    optimizer = _torch_optimizer(engine)
    variants = [group.get(VARIANT_FLAG) for group in optimizer.param_groups] if optimizer else []
    load_path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    for group, variant in zip(optimizer.param_groups if optimizer else [], variants):
        # torch's load_state_dict takes the saved groups whole: keep this run's algorithm (AdamW).
        if variant is not None:
            group[VARIANT_FLAG] = variant
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
    if not args.no_load_rng:
        _restore_rng_states(client_state, load_dir)
    iteration = client_state["iteration"]
    saved_args = client_state.get("args")
    if saved_args is not None:
        consumed_samples = getattr(saved_args, "consumed_train_samples", 0)
    else:
        consumed_samples = client_state.get("consumed_train_samples", 0)
    consumed_tokens = client_state.get("tokens", 0)
    print_rank_0(f"> loaded checkpoint {load_path} at iteration {iteration}")
    return iteration, consumed_samples, consumed_tokens


def saved_client_state(load_dir, tag):
    """The client state a checkpoint was written with (None for a checkpoint without model-states files).

    Every model-states file of a checkpoint holds the same client state; the first one is read
    (memory-mapped, so a plain engine's weights in it are not read in).
    """
    directory = os.path.join(load_dir, tag)
    names = sorted(name for name in os.listdir(directory)
                   if name.endswith("model_states.pt") and not name.startswith("layer_"))
    if not names:
        return None  # DeepSpeed's load says what is missing
    path = os.path.join(directory, names[0])
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (ModuleNotFoundError, AttributeError) as error:  # a class the writer pickled that is not here
        raise CheckpointError(f"cannot unpickle {path}: {error}") from None


def saved_args(load_dir, tag):
    """The args a checkpoint was written with (None for a checkpoint without them or without files)."""
    state = saved_client_state(load_dir, tag)
    return None if state is None else state.get("args")


def has_rng_state(client_state):
    return "rng_state" in client_state or "torch_rng_state" in client_state


def _check_saved_args(load_dir, tag, args):
    """Compare shapes before DeepSpeed loads: its own error for a mismatch is a tensor-size traceback."""
    saved = saved_args(load_dir, tag)
    if saved is not None:
        check_checkpoint_args(saved, args)


def _fsync_tree(directory):
    """Flush every file, then the directories, so a rename never publishes data still in flight."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_directory(source, target):
    """rename(2) cannot replace a non-empty directory: move an older save of the same iteration aside first."""
    replaced = target + ".replaced"
    if os.path.isdir(replaced):
        shutil.rmtree(replaced)
    if os.path.isdir(target):
        os.rename(target, replaced)
    os.rename(source, target)
    _fsync_dir(os.path.dirname(os.path.abspath(target)))
    if os.path.isdir(replaced):
        shutil.rmtree(replaced)


def _write_file_atomically(path, text):
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
