"""The bytes each layer's forward keeps for its backward, per micro-batch, as the iteration ran.

What autograd keeps for backward is read off the graph a forward leaves, once that forward has returned: each new
graph node's saved tensors (its `_raw_saved_*` SavedTensors' data, a custom Function's included). No
saved-tensor hook is installed: under one, autograd hands a backward a fresh tensor object for every tensor it
saved, parameters included, so a backward that sets `weight.grad` (upstream's WeightGradStore) or reads an
attribute of its weight (Megatron's `main_grad`) would act on a copy, and the measured iteration would train
differently (or its stages reduce different gradients and hang). A SavedTensor's data is read without unpacking
it: nothing is made or run. Each storage is counted once per micro-batch (a tensor saved by two ops,
or a layer's output saved as the next layer's input, once: for the layer whose graph holds it first),
parameters and module buffers not at all. Where it is counted:

- to the layer that made the node (a PipelineModule's forward_funcs entry, proxied while measuring): its graph,
  walked from its outputs back to its inputs, once it returns;
- a checkpointed chunk's inputs to the chunk's first layer: a checkpointed layer keeps its input only. Every
  checkpoint keeps the tensors it is called with until its backward (on its autograd context, or saved): they are
  counted from the call itself (activation_checkpoint_func, proxied while measuring), and the chunk's own graph is
  never read (torch's non-reentrant checkpoint saves through hooks of its own, whose unpack recomputes);
- the rest of the micro-batch's graph (the loss on the last stage), walked from the forward's outputs
  (forwarded(), at its instruction's end), to the stage itself.

What a checkpointed layer saves when its forward is re-run in backward (recompute) is counted apart, from the
graph of that call: it is alive only while that micro-batch's backward runs. So is what each layer's forward is
called with (its input): what a checkpoint of that layer alone would keep. So one run gives a layer's bytes both
ways: kept whole (a layer run plainly: what it keeps; a recomputed one: what its recompute saves) and kept as a
checkpoint (its input; a recomputed one: what it keeps). Tensors saved under someone else's
saved-tensor hooks are not read (their unpack is theirs to run): a layer that runs under them counts nothing.
"""
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set

import torch

from patches.profiler.fail_safe import MEMORY, FaultLog
from patches.profiler.held_state import read_storage, storage_key
from patches.profiler.shadowing import shadow

_graph_task_id = torch._C._current_graph_task_id
# How a layer's call is counted (KeptActivations._before_layer).
_FORWARD, _RECOMPUTE = "forward", "recompute"
_RAW_SAVED_PREFIX = "_raw_saved_"


@dataclass(frozen=True)
class KeptBytes:
    """Per micro-batch: the most any one micro-batch kept."""
    layers: Dict[int, int]  # a layer's global index -> bytes it keeps for backward
    outside_layers: int  # bytes kept by no layer (the loss; a plain module's forward)
    recompute: Dict[int, int] = field(default_factory=dict)  # layer index -> bytes its recompute saves
    micro_batches: int = 0  # forwards seen
    # layer index -> the bytes of the tensors its forward is called with: what a checkpoint of it alone keeps
    inputs: Dict[int, int] = field(default_factory=dict)


class KeptActivations:
    """The proxies that count saved tensors on one stage module (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, faults: Optional[FaultLog] = None):
        """faults: where an error of its proxies' counting is recorded (it runs inside the user's forward and
        backward); after one, the proxies only call what they proxy."""
        self.module = module
        self.faults = faults if faults is not None else FaultLog()
        self._excluded: Set[object] = set()
        self._chunk: Optional[_Chunk] = None  # the checkpointed chunk running now
        self._seen: Set[object] = set()  # storages counted in this micro-batch
        # grad_fn of what the layers and chunks of this micro-batch's forward returned: a walk stops there (held
        # until the forward's end only; the graph holds them then anyway)
        self._walked: List[Any] = []
        self._micro_batches: List[Dict[Optional[int], int]] = []  # per forward: layer (None: outside) -> bytes
        self._recompute: Dict[int, int] = {}
        self._inputs: Dict[int, int] = {}
        self._undo: List[Callable[[], None]] = []

    def attach(self) -> None:
        """Proxy the layers and the checkpoint function, and mark each forward's start."""
        module = self.module
        for tensor in list(module.parameters()) + list(module.buffers()):
            key = storage_key(tensor)
            if key is not None:
                self._excluded.add(key)
        handle = module.register_forward_pre_hook(self._new_micro_batch)
        self._undo.append(handle.remove)
        funcs = getattr(module, "forward_funcs", None)
        if funcs is None:
            return
        first = getattr(module, "_local_start", 0)
        for position, func in enumerate(funcs):
            funcs[position] = self._layer_proxy(first + position, func)
            self._undo.append(functools.partial(funcs.__setitem__, position, func))
        checkpoint = getattr(module, "activation_checkpoint_func", None)
        if checkpoint is not None:
            self._undo.append(shadow(module, "activation_checkpoint_func", self._chunk_proxy(checkpoint)))

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self._walked = []

    def forwarded(self, outputs: Iterable[Any]) -> None:
        """A micro-batch's forward is over (its instruction's end): what its graph, walked back from `outputs`
        (the stage's outputs, the loss), saved outside any layer counts to the stage."""
        if _graph_task_id() == -1 and not _foreign_hooks():
            stop = self._walked
            for tensor in _saved_in_graph(_tensors(list(outputs)), stop):
                self._count(tensor, None)
        self._walked = []

    def result(self) -> KeptBytes:
        layers: Dict[int, int] = {}
        outside = 0
        for kept in self._micro_batches:
            for layer, size in kept.items():
                if layer is None:
                    outside = max(outside, size)
                else:
                    layers[layer] = max(layers.get(layer, 0), size)
        return KeptBytes(layers, outside, dict(self._recompute), len(self._micro_batches), dict(self._inputs))

    def _new_micro_batch(self, module, args) -> None:
        if _graph_task_id() == -1 and not self.faults.failed(MEMORY):
            self._micro_batches.append({})
            self._seen = set()
            self._walked = []

    def _layer_proxy(self, index: int, func: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args, **kwargs):
            how = None
            if not self.faults.failed(MEMORY):
                with self.faults.guard(MEMORY, f"layer {index}'s call"):
                    how = self._before_layer(index)
            result = func(*args, **kwargs)
            if how in (_FORWARD, _RECOMPUTE):
                with self.faults.guard(MEMORY, f"layer {index}'s call"):
                    self._after_layer(index, how, args, kwargs, result)
            return result
        return run

    def _before_layer(self, index: int) -> Optional[str]:
        """How a layer's call is counted: None where it is not (a checkpoint's forward, whose chunk counts it;
        saved through someone else's hooks)."""
        if self._chunk is not None:  # a checkpoint's forward: the chunk's call counts it
            if self._chunk.first is None:
                self._chunk.first = index
            return None
        recomputing = _graph_task_id() != -1  # re-run inside backward: a checkpointed layer's recompute
        if recomputing:
            self._recompute.setdefault(index, 0)
        if _foreign_hooks():  # saved through someone else's hooks (a non-reentrant checkpoint's): not read
            return None
        return _RECOMPUTE if recomputing else _FORWARD

    def _after_layer(self, index: int, how: str, args: tuple, kwargs: dict, result: Any) -> None:
        outputs = _tensors(result if isinstance(result, (tuple, list)) else [result])
        inputs = [t.grad_fn for t in _tensors(list(args) + list(kwargs.values())) if t.grad_fn is not None]
        if how == _RECOMPUTE:
            size = self._bytes_of(_saved_in_graph(outputs, inputs))
            self._recompute[index] = max(self._recompute.get(index, 0), size)
            return
        self._called_with(index, list(args) + list(kwargs.values()))
        for tensor in _saved_in_graph(outputs, inputs + self._walked):
            self._count(tensor, index)
        self._walked += [t.grad_fn for t in outputs if t.grad_fn is not None]

    def _chunk_proxy(self, checkpoint: Callable[..., Any]) -> Callable[..., Any]:
        def run(function, *args, **kwargs):
            if self.faults.failed(MEMORY):
                return checkpoint(function, *args, **kwargs)
            outer, self._chunk = self._chunk, _Chunk()
            try:
                result = checkpoint(function, *args, **kwargs)
            finally:
                chunk, self._chunk = self._chunk, outer
            if _graph_task_id() == -1 and outer is None:  # the checkpoint keeps its inputs till its backward
                with self.faults.guard(MEMORY, "a checkpointed chunk's call"):
                    for tensor in _tensors(list(args)) + _tensors(list(kwargs.values())):
                        self._count(tensor, chunk.first)
                    self._called_with(chunk.first, list(args) + list(kwargs.values()))
                    outputs = _tensors(result if isinstance(result, (tuple, list)) else [result])
                    self._walked += [t.grad_fn for t in outputs if t.grad_fn is not None]  # its graph is not read
            return result
        return run

    def _bytes_of(self, tensors: Iterable[torch.Tensor]) -> int:
        """The bytes of these tensors' storages, each once, parameters and buffers not at all."""
        seen, size = set(), 0
        for tensor in tensors:
            read = read_storage(tensor)
            if read is not None and read.key not in self._excluded and read.key not in seen:
                seen.add(read.key)
                size += read.nbytes
        return size

    def _called_with(self, layer: Optional[int], values: List[Any]) -> None:
        """A layer's forward (or its checkpointed chunk's) was called with `values`: the most any micro-batch's
        call held, what a checkpoint of that layer alone keeps."""
        if layer is not None:
            self._inputs[layer] = max(self._inputs.get(layer, 0), self._bytes_of(_tensors(values)))

    def _count(self, tensor: torch.Tensor, layer: Optional[int]) -> None:
        """A storage kept in this micro-batch, counted to `layer` (None: the stage) unless counted already."""
        read = read_storage(tensor)
        if read is None or read.key in self._excluded or read.key in self._seen or not self._micro_batches:
            return
        self._seen.add(read.key)
        kept = self._micro_batches[-1]
        kept[layer] = kept.get(layer, 0) + read.nbytes


@dataclass
class _Chunk:
    """A checkpointed chunk while it runs: the first layer it runs, which its inputs count to."""
    first: Optional[int] = None


def _foreign_hooks() -> bool:
    """Saved-tensor hooks are on (this measurement installs none): what is saved now is unpacked by them."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def _saved_in_graph(outputs: Sequence[torch.Tensor], stop: Sequence[Any]) -> Iterator[torch.Tensor]:
    """The tensors saved by the graph nodes behind `outputs`, not walking into or past a node of `stop`. The
    nodes met are held only while the walk runs (ids are compared while their objects are alive)."""
    stopped = {id(node) for node in stop}
    held = list(stop)
    visited: Set[int] = set()
    pending = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while pending:
        node = pending.pop()
        if node is None or id(node) in visited or id(node) in stopped:
            continue
        visited.add(id(node))
        held.append(node)
        yield from _saved_by(node)
        pending.extend(next_node for next_node, _ in node.next_functions)


def _saved_by(node: Any) -> List[torch.Tensor]:
    """What one graph node saved for backward: its SavedTensors' data, read without unpacking them (nothing is
    made or run); one saved through hooks (a non-reentrant checkpoint's) holds what its hook packed: not read."""
    found: List[torch.Tensor] = []
    for name in dir(node):
        if not name.startswith(_RAW_SAVED_PREFIX):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed already (a graph backwarded): nothing kept
            continue
        for saved in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(saved, torch._C._autograd.SavedTensor):
                tensor = _unhooked_data(node, name, saved)
                if isinstance(tensor, torch.Tensor):
                    found.append(tensor)
    return found


def _unhooked_data(node: Any, name: str, saved: Any) -> Optional[torch.Tensor]:
    if hasattr(saved, "unpack_hook"):
        return saved.data if saved.unpack_hook is None else None
    # torch before SavedTensor.data (2.5): the node's unpacked field, where it has one
    value = getattr(node, "_saved_" + name[len(_RAW_SAVED_PREFIX):], None) if name != "_raw_saved_tensors" else None
    return value if isinstance(value, torch.Tensor) else None


def _tensors(values: Sequence[Any]) -> List[torch.Tensor]:
    """The tensors among `values`, in tuples and lists too."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found += _tensors(value)
    return found

