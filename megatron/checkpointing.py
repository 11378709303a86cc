"""Checkpoints through DeepSpeed's save/load, with Megatron's iteration and data position, saved atomically.

DeepSpeed writes every rank's files straight into `save_dir/<tag>/`, and global rank 0 writes
`latest` as soon as its own files are done, without waiting for the other ranks: a rank killed while
saving leaves a `latest` naming a checkpoint that lacks that rank's files. Here every rank writes
into `<tag>.incomplete/`; once all ranks are past DeepSpeed's closing barrier, global rank 0 flushes
the files, renames the directory to `<tag>` and only then replaces `latest` (write a temporary file,
rename it). A run killed at any point leaves `latest` naming a complete checkpoint, or the previous
one. The rename is done by global rank 0, so `--save` must be a filesystem every rank sees.
"""
import os
import re
import shutil

import torch

from megatron import mpu
from megatron.utils import print_rank_0

LATEST_FILE = "latest"
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


def _rng_state():
    return {"torch": torch.get_rng_state(), "tensor_parallel": mpu.get_cuda_rng_tracker().get_states()}


def save_checkpoint(engine, save_dir, iteration, consumed_train_samples):
    """Collective: every rank calls it."""
    tag = checkpoint_tag(iteration)
    staging = os.path.join(save_dir, tag + INCOMPLETE_SUFFIX)
    first = torch.distributed.get_rank() == 0
    if first and os.path.isdir(staging):
        shutil.rmtree(staging)  # left by a run killed while saving; DeepSpeed barriers before anyone writes
    client_state = {"iteration": iteration, "consumed_train_samples": consumed_train_samples,
                    "rng_state": _rng_state()}
    # Returns on every rank only after DeepSpeed's closing barrier: all files of all ranks are written.
    engine.save_checkpoint(save_dir, tag=tag + INCOMPLETE_SUFFIX, client_state=client_state, save_latest=False)
    if first:
        _fsync_tree(staging)
        _replace_directory(staging, os.path.join(save_dir, tag))
        _write_file_atomically(os.path.join(save_dir, LATEST_FILE), tag)
    torch.distributed.barrier()  # nobody reads `latest` or the directory before it is in place
    print_rank_0(f"> saved checkpoint at iteration {iteration} to {save_dir}")


def load_checkpoint(engine, load_dir):
    """Returns (iteration, consumed_train_samples); (0, 0) when load_dir holds no checkpoint yet."""
    tag = read_latest_tag(load_dir)
    if tag is None:
        print_rank_0(f"> no checkpoint found in {load_dir}, training from scratch")
        return 0, 0
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise CheckpointError(f"{os.path.join(load_dir, LATEST_FILE)} names {tag}, which is not in {load_dir}")
    load_path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
    rng = client_state.get("rng_state")
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        mpu.get_cuda_rng_tracker().set_states(rng["tensor_parallel"])
    iteration = client_state["iteration"]
    print_rank_0(f"> loaded checkpoint {load_path} at iteration {iteration}")
    return iteration, client_state["consumed_train_samples"]


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
