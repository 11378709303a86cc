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
carries upstream's keys (`args` with `consumed_train_samples`, `checkpoint_version` 3.0, `iteration`,
`tokens`, and the RNG states `random_rng_state`, `np_rng_state`, `torch_rng_state`, `cuda_rng_state`
where CUDA is used, `rng_tracker_states`), so either side can resume the other's run. A checkpoint of a
different model shape or parallel layout is refused with one line naming the first value that differs.
"""
import argparse
import os
import pickle
import random
import re
import shutil

import numpy as np
import torch

from megatron import mpu
from megatron.utils import print_rank_0

LATEST_FILE = "latest"
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # upstream's tracker: the iteration as text
CHECKPOINT_VERSION = 3.0
# Values a checkpoint must share with the run that loads it (upstream checks the same ones).
MUST_MATCH = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "padded_vocab_size",
              "tensor_model_parallel_size", "pipeline_model_parallel_size")
INCOMPLETE_SUFFIX = ".incomplete"
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


def latest_iteration(load_dir):
    """The iteration of the checkpoint --load would resume from, or None (no checkpoint, or not ours)."""
    tag = read_latest_tag(load_dir)
    match = _TAG_PATTERN.fullmatch(tag) if tag else None
    return int(match.group(1)) if match else None


def _rng_states():
    states = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
              "torch_rng_state": torch.get_rng_state(),
              "rng_tracker_states": mpu.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda_rng_state"] = torch.cuda.get_rng_state()
    return states


def _restore_rng_states(client_state):
    if "torch_rng_state" in client_state:  # upstream's keys
        random.setstate(client_state["random_rng_state"])
        np.random.set_state(client_state["np_rng_state"])
        torch.set_rng_state(client_state["torch_rng_state"])
        if "cuda_rng_state" in client_state and torch.cuda.is_available():
            torch.cuda.set_rng_state(client_state["cuda_rng_state"])
        mpu.get_cuda_rng_tracker().set_states(client_state["rng_tracker_states"])
    elif "rng_state" in client_state:  # written by earlier versions of this fork
        torch.set_rng_state(client_state["rng_state"]["torch"])
        mpu.get_cuda_rng_tracker().set_states(client_state["rng_state"]["tensor_parallel"])


def _picklable_args(args):
    """The run's args as upstream stores them, less values that cannot be pickled (open writers, ...)."""
    kept = {}
    for name, value in vars(args).items():
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
                    "tokens": args.consumed_train_tokens, **_rng_states()}
    # Returns on every rank only after DeepSpeed's closing barrier: all files of all ranks are written.
    engine.save_checkpoint(save_dir, tag=tag + INCOMPLETE_SUFFIX, client_state=client_state, save_latest=False)
    if first:
        _fsync_tree(staging)
        _replace_directory(staging, os.path.join(save_dir, tag))
        _write_file_atomically(os.path.join(save_dir, LATEST_FILE), tag)
        _write_file_atomically(os.path.join(save_dir, TRACKER_FILE), str(iteration))
    torch.distributed.barrier()  # nobody reads `latest` or the directory before it is in place
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}")


def check_checkpoint_args(saved_args, args):
    """Raise CheckpointError naming the first shape or layout value that differs from the run's."""
    for name in MUST_MATCH:
        if hasattr(saved_args, name) and hasattr(args, name) and getattr(saved_args, name) != getattr(args, name):
            raise CheckpointError(f"the checkpoint has {name} {getattr(saved_args, name)}, this run "
                                  f"{getattr(args, name, None)}: a checkpoint loads only into the same model and "
                                  f"tensor/pipeline layout")


def load_checkpoint(engine, load_dir, args):
    """Returns (iteration, consumed_train_samples, consumed_train_tokens); zeros when load_dir holds none."""
    tag = read_latest_tag(load_dir)
    if tag is None:
        print_rank_0(f"> no checkpoint found in {load_dir}, training from scratch")
        return 0, 0, 0
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise CheckpointError(f"{os.path.join(load_dir, LATEST_FILE)} names {tag}, which is not in {load_dir}")
    _check_saved_args(load_dir, tag, args)
    load_path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
    _restore_rng_states(client_state)
    iteration = client_state["iteration"]
    saved_args = client_state.get("args")
    if saved_args is not None:
        consumed_samples = getattr(saved_args, "consumed_train_samples", 0)
    else:
        consumed_samples = client_state.get("consumed_train_samples", 0)
    consumed_tokens = client_state.get("tokens", 0)
    print_rank_0(f"> loaded checkpoint {load_path} at iteration {iteration}")
    return iteration, consumed_samples, consumed_tokens


def saved_args(load_dir, tag):
    """The args a checkpoint was written with (None for a checkpoint without them or without files).

    Every model-states file of a checkpoint holds the same client state; the first one is read
    (memory-mapped, so a plain engine's weights in it are not read in).
    """
    directory = os.path.join(load_dir, tag)
    names = sorted(name for name in os.listdir(directory)
                   if name.endswith("model_states.pt") and not name.startswith("layer_"))
    if not names:
        return None  # DeepSpeed's load says what is missing
    return torch.load(os.path.join(directory, names[0]), map_location="cpu", weights_only=False, mmap=True).get("args")


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
