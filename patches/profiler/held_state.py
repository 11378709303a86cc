"""The tensor storages a stage holds, counted as they are held: its parameters, their gradients, the optimizer's state,
and every storage alive in the process.

Everything is counted by storage, each once: a parameter that is a view into one of DeepSpeed's flat buffers (ZeRO's
bit16 groups) counts that buffer, padding included, and the fp32 master copies, flat gradient partitions and
moments a DeepSpeed optimizer keeps count as it allocated them, in their own dtypes.

- parameters: the storages of the stage module's parameters;
- gradients: the storages of those parameters' `.grad`, of the `.grad` of every tensor the optimizer holds, and of
  every tensor the optimizer holds under an attribute or key whose name says gradient (ZeRO's `averaged_gradients`
  and gradient partitions, the bf16 optimizer's flat gradient buffers);
- optimizer: every other storage the engine's optimizer reaches through its attributes, containers and state
  (Adam's moments and step counters, fp32 master weights, flat buffers), modules excepted;
- fixed: DeepSpeed ZeRO's gradient reduction buckets (reduction_buckets), whatever the walk reaches them as: they
  are sized by the optimizer's reduce_bucket_size, not by the stage's parameters, so they are no part of the state
  that moves with a layer.
"""
import gc
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

# A storage as the allocator knows it: (device, address) -> bytes.
Storages = Dict[Tuple[str, int], int]

# The optimizer's own objects are walked this deep (ZeRO: optimizer -> dict -> list -> list -> tensor is 4).
_WALK_DEPTH = 8
# Below the optimizer itself, objects of these packages (and optimizers) are walked into; others are not.
_WALKED_PACKAGES = ("torch", "deepspeed", "apex", "megatron")


@dataclass(frozen=True)
class ReadStorage:
    """A tensor's storage as the allocator holds it: its key, its bytes, and the storage object itself."""
    key: Tuple[str, int]  # (device, address)
    nbytes: int
    storage: torch.UntypedStorage


def read_storage(tensor: torch.Tensor) -> Optional[ReadStorage]:
    """The allocated storage under `tensor`, or None for a tensor that holds none the allocator gave: meta, sparse,
    an empty one, and any tensor whose storage cannot be read (the fake tensors torch.compile leaves alive, a
    functional tensor, a wrapper subclass without storage). Never raises: what it cannot read is no storage."""
    try:
        storage = tensor.untyped_storage()
        if storage.device.type == "meta":
            return None
        address = storage.data_ptr()
        if address == 0:
            return None
        return ReadStorage((str(storage.device), address), storage.nbytes(), storage)
    except Exception:  # a tensor kind whose storage torch will not show holds none that can be counted
        return None


def storage_key(tensor: torch.Tensor) -> Optional[Tuple[str, int]]:
    """(device, address) of the storage under `tensor`; None where read_storage finds none."""
    read = read_storage(tensor)
    return read.key if read is not None else None


def _add(storages: Storages, tensor: torch.Tensor) -> None:
    read = read_storage(tensor)
    if read is not None:
        storages.setdefault(read.key, read.nbytes)


@dataclass(frozen=True)
class HeldState:
    """A stage's parameters, gradients and optimizer state as held at one moment: storages by (device, address)."""
    params: Storages
    grads: Storages
    optimizer: Storages
    fixed: Storages = field(default_factory=dict)

    @property
    def param_bytes(self) -> int:
        return sum(self.params.values())

    @property
    def grad_bytes(self) -> int:
        return sum(self.grads.values())

    @property
    def optimizer_bytes(self) -> int:
        return sum(self.optimizer.values())

    @property
    def fixed_bytes(self) -> int:
        return sum(self.fixed.values())

    def state(self) -> Storages:
        """The parameters, gradients and optimizer state: what scales with the parameters."""
        return {**self.optimizer, **self.grads, **self.params}

    def all(self) -> Storages:
        return {**self.fixed, **self.state()}


def held_state(module: torch.nn.Module, optimizer: Optional[object]) -> HeldState:
    """What `module` and `optimizer` hold now (see the module docstring); a storage reached both as a parameter and
    otherwise is a parameter's, one reached as a gradient and otherwise a gradient's, a reduction bucket is fixed
    however else it is reached."""
    params: Storages = {}
    grads: Storages = {}
    for param in module.parameters():
        _add(params, param)
    for param in module.parameters():
        if param.grad is not None:
            _add(grads, param.grad)
    held: Storages = {}
    fixed: Storages = {}
    if optimizer is not None:
        fixed = reduction_buckets(optimizer)
        for tensor, is_gradient in _tensors_of(optimizer):
            _add(grads if is_gradient else held, tensor)
    for key in list(grads):
        if key in params or key in fixed:
            del grads[key]
    optimizer_storages = {key: size for key, size in held.items()
                          if key not in params and key not in grads and key not in fixed}
    return HeldState(params, grads, optimizer_storages, fixed)


def reduction_buckets(optimizer: object) -> Storages:
    """The storages of DeepSpeed ZeRO's gradient reduction buckets that `optimizer` holds now (none where it is no
    ZeRO optimizer, or between reductions: ZeRO makes them for a reduction and lets them go after it). Each holds
    reduce_bucket_size elements whatever the parameters (500M by default). Found by the attributes that hold them:
    `ipg_buffer`, a list of tensors (DeepSpeed 0.16), or `ipg_buckets`, a dtype -> bucket dict whose buckets hold
    that list as `buffer` (0.19)."""
    tensors = list(getattr(optimizer, "ipg_buffer", None) or ())
    buckets = getattr(optimizer, "ipg_buckets", None)
    for bucket in (buckets.values() if isinstance(buckets, dict) else ()):
        tensors += list(getattr(bucket, "buffer", None) or ())
    storages: Storages = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            _add(storages, tensor)
    return storages


def _names_gradient(name: object) -> bool:
    return isinstance(name, str) and "grad" in name.lower()


def _tensors_of(root: object) -> Iterator[Tuple[torch.Tensor, bool]]:
    """(tensor, held as a gradient) for every tensor reachable from an optimizer through attributes, lists, tuples,
    sets and dicts (keys too: torch's optimizers key their state by parameter), and every such tensor's `.grad`;
    modules are not entered (the parameters are counted from the stage module), nor, below the optimizer itself,
    objects of other libraries than torch's, DeepSpeed's, apex's and Megatron's."""
    seen = set()
    stack = [(root, 0, False)]
    while stack:
        value, depth, under_gradient = stack.pop()
        if id(value) in seen or depth > _WALK_DEPTH:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield value, under_gradient
            if value.grad is not None:
                yield value.grad, True
        elif isinstance(value, torch.nn.Module):
            continue
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, depth + 1, under_gradient))
                stack.append((item, depth + 1, under_gradient or _names_gradient(key)))
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((item, depth + 1, under_gradient) for item in value)
        elif hasattr(value, "__dict__") and (depth == 0 or isinstance(value, torch.optim.Optimizer)
                                             or type(value).__module__.split(".")[0] in _WALKED_PACKAGES):
            for name, item in vars(value).items():
                stack.append((item, depth + 1, under_gradient or _names_gradient(name)))


def alive_storages(device_type: str, on_each: Optional[Callable[[torch.UntypedStorage, int], None]] = None
                   ) -> Storages:
    """Every storage on devices of `device_type` that a Python tensor holds now, each once. Python's garbage
    collector tracks every tensor object, so this is every storage but those only C++ holds (an autograd graph's
    saved tensors, a gradient never read from Python): call it between iterations, and add held_state's, which reads
    the gradients from Python. on_each(storage, bytes): called once per storage found."""
    found: Storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some deprecated torch objects warn on
        if not issubclass(type(obj), torch.Tensor):
            continue
        read = read_storage(obj)
        if read is None or read.key in found or read.storage.device.type != device_type:
            continue
        found[read.key] = read.nbytes
        if on_each is not None:
            on_each(read.storage, read.nbytes)
    return found
