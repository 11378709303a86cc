"""A run that finished exits 0: the process groups end while the interpreter is whole.

torch (2.13) lets a gloo worker thread drop a finished collective's tensors after the caller has
returned from it; dropping a tensor with a Python object takes the GIL. A worker that asks for the
GIL once the interpreter has started finalizing is ended by it, inside a C++ destructor, and the
process aborts ("terminate called without an active exception", exit -6) although the run succeeded.
destroy_process_group() forgets the groups but does not end the workers (gloo has no shutdown): a gloo
group joins its worker threads when its last reference goes, and torch drops that reference without
the GIL. So the teardown lets go of every reference this process keeps beyond torch's registry (our
layout, DeepSpeed's module-level groups) and collects the reference
cycles that hold the rest (engines and their grids): the groups go, and their workers are joined,
before finalization starts. What a script still holds itself (an engine in a global) it should drop
before it ends.
"""
import atexit
import gc
import sys

import torch

# DeepSpeed modules that keep process groups in globals (0.14 to 0.19), by module name.
DEEPSPEED_GROUP_HOLDERS = ("deepspeed.runtime.activation_checkpointing.checkpointing", "deepspeed.utils.groups")


def teardown_process_groups() -> None:
    """Destroy every process group of this process and release every reference to them we know of."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        release_group_references()
        gc.collect()  # engines, grids and profilers in reference cycles go now, and their groups with them


def release_group_references() -> None:
    """Forget the groups held outside torch's registry: ours and DeepSpeed's module globals. A module never
    imported holds none (and importing DeepSpeed at exit would cost seconds)."""
    mpu = sys.modules.get("megatron.mpu.parallel_state")
    if mpu is not None:
        mpu.destroy_model_parallel()
    for name in DEEPSPEED_GROUP_HOLDERS:
        module = sys.modules.get(name)
        if module is not None:
            _forget_groups_in(vars(module))


def _forget_groups_in(namespace: dict) -> None:
    """A module's globals: process groups set to None, dicts of them emptied."""
    group_type = torch.distributed.ProcessGroup
    for name, value in list(namespace.items()):
        if isinstance(value, group_type):
            namespace[name] = None
        elif isinstance(value, dict) and any(isinstance(v, group_type) for v in value.values()):
            value.clear()


def at_exit() -> None:
    """Register the teardown to run at a normal interpreter exit (a rank leaving by os._exit skips it)."""
    atexit.register(teardown_process_groups)
