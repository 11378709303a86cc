"""A run that finished exits 0: its process groups end while the interpreter is whole.

torch (2.13) lets a gloo worker thread drop a finished collective's tensors after the caller has returned
from it, and dropping a tensor that has a Python object takes the GIL. A thread that asks for the GIL once
the interpreter has started finalizing is ended by it, inside a C++ destructor: the process aborts
("terminate called without an active exception", exit -6, the deepspeed launcher's 250) although the run
succeeded. destroy_process_group() forgets the groups but does not end their workers (gloo has no
shutdown): a gloo group joins its worker threads when its last reference goes. So the teardown, at exit
and before finalization, destroys the groups, lets go of every reference to them it knows of (the
profiler's report groups, DeepSpeed's module globals, whatever `releases` the caller adds) and collects the
reference cycles that hold the rest (engines and their grids): the groups go, and their workers are joined,
while the interpreter can still serve them. What a script still holds itself (an engine in a global) it
should drop before it ends. At exit, torch's DataLoader iterators are told first that the interpreter is exiting,
as torch's own handler would tell them later (data_loaders_leave_workers_to_exit says why).

`python -m patches.launch` registers it for a user's own Megatron-DeepSpeed (whose `pretrain` never ends its
groups); our GPT fork registers it with its own layout's release added.
"""
import atexit
import gc
import sys
import types
from typing import Callable

import torch

# DeepSpeed modules that keep process groups in globals (0.14 to 0.19), by module name: utils.groups (its
# world, data, model and expert groups; `mpu`, a pipeline's grid), activation checkpointing (`mp_group`),
# pipe.p2p (`_grid`, the pipeline's grid; `_groups`), sequence parallelism's state (in 0.19.6, not in 0.16.9).
DEEPSPEED_GROUP_HOLDERS = ("deepspeed.utils.groups", "deepspeed.runtime.activation_checkpointing.checkpointing",
                           "deepspeed.runtime.pipe.p2p", "deepspeed.runtime.sequence_parallel.parallel_state_sp")


def teardown_process_groups(*releases: Callable[[], None]) -> None:
    """Destroy every process group of this process and release every reference to them we know of; each of
    `releases` (e.g. the caller's own layout's teardown) is called after the destroy."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for release in releases:
        release()
    release_group_references()
    gc.collect()  # engines, grids and profilers in reference cycles go now, and their groups with them


def release_group_references() -> None:
    """Forget the groups held outside torch's registry: the profiler's report groups (on every engine's
    attachment, which may outlive the run: an engine the script still reaches) and DeepSpeed's module globals.
    A module never imported holds none (and importing DeepSpeed at exit would cost seconds)."""
    registry = sys.modules.get("patches.process.registry")
    if registry is not None:
        for attachment in list(registry.REGISTRY.attachments):
            attachment.report_groups = None
    for name in DEEPSPEED_GROUP_HOLDERS:
        module = sys.modules.get(name)
        if module is not None:
            _forget_groups_in(vars(module))


def _holds_groups(value: object, group_type: type) -> bool:
    """A group, a dict, list or tuple of groups, or an object (not a module or class) with groups among its
    attributes (pipe.p2p's grid)."""
    if isinstance(value, dict):
        return any(isinstance(v, group_type) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, group_type) for v in value)
    if isinstance(value, (types.ModuleType, type)):
        return False
    attributes = getattr(value, "__dict__", {})
    return isinstance(value, group_type) or any(isinstance(v, group_type) for v in attributes.values())


def _forget_groups_in(namespace: dict) -> None:
    """A module's globals: whatever holds process groups (a group, a dict or list of them, an object with them
    among its attributes) set to None, dicts of them emptied."""
    group_type = torch.distributed.ProcessGroup
    for name, value in list(namespace.items()):
        if not _holds_groups(value, group_type):
            continue
        if isinstance(value, dict):
            value.clear()
        else:
            namespace[name] = None


def at_exit(*releases: Callable[[], None]) -> None:
    """Register the teardown (with `releases`) to run at a normal interpreter exit (a rank leaving by os._exit
    skips it). Handlers run last-registered first: register it before anything that must stop before it."""
    atexit.register(_teardown_at_exit, *releases)


def _teardown_at_exit(*releases: Callable[[], None]) -> None:
    data_loaders_leave_workers_to_exit()
    teardown_process_groups(*releases)


def data_loaders_leave_workers_to_exit() -> None:
    """Tell torch's DataLoader iterators now, as torch's own exit handler (registered earlier, so run later) would,
    that the interpreter is exiting: an iterator then leaves its worker processes (daemonic) to multiprocessing's
    exit, which ends them at once. Without it, the teardown's gc.collect() finalizes an iterator held in a reference
    cycle (the training loop's data iterator) after the weak-reference finalizers of its own index queues have closed
    them: the stop it sends never reaches a worker, and it waits out torch's 5 s join timeout for each (measured:
    rank 0 of our GPT with the default 2 workers exited 10 s late, every run)."""
    data_utils = sys.modules.get("torch.utils.data._utils")
    if data_utils is not None and hasattr(data_utils, "python_exit_status"):
        data_utils.python_exit_status = True
