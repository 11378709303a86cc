"""The bytes each layer's forward keeps for its backward, per micro-batch, as the iteration ran.

torch's saved_tensors_hooks see every tensor autograd saves for backward; each storage is counted once per
micro-batch (a tensor saved by two ops, or a layer's output saved as the next layer's input, once: for the layer
that saved it first), parameters and module buffers not at all. Where it is counted:

- to the layer running (a PipelineModule's forward_funcs entry, proxied while measuring);
- a checkpointed chunk's inputs to the chunk's first layer: a checkpointed layer keeps its input only. Every
  checkpoint keeps the tensors it is called with until its backward, but not every one saves them where a hook
  sees (DeepSpeed's keeps them as an attribute of its autograd context): they are counted from the call itself
  (activation_checkpoint_func, proxied while measuring), once per storage like any other;
- anything else (the loss on the last stage, a plain engine's whole forward) to the stage itself.

What a checkpointed layer saves when its forward is re-run in backward (recompute) is counted apart: it is alive
only while that micro-batch's backward runs.
"""
import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set

import torch

from patches.profiler.held_state import storage_key

_graph_task_id = torch._C._current_graph_task_id


@dataclass(frozen=True)
class KeptBytes:
    """Per micro-batch: the most any one micro-batch kept."""
    layers: Dict[int, int]  # a layer's global index -> bytes it keeps for backward
    outside_layers: int  # bytes kept by no layer (the loss; a plain module's forward)
    recompute: Dict[int, int] = field(default_factory=dict)  # layer index -> bytes its recompute saves
    micro_batches: int = 0  # forwards seen


class KeptActivations:
    """The hooks that count saved tensors on one stage module (see the module docstring)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._excluded: Set[object] = set()
        self._layer: Optional[int] = None  # the layer running now
        self._chunk: Optional[_Chunk] = None  # the checkpointed chunk running now
        self._seen: Set[object] = set()  # storages counted in this micro-batch
        self._micro_batches: List[Dict[Optional[int], int]] = []  # per forward: layer (None: outside) -> bytes
        self._recompute: Dict[int, int] = {}
        self._recompute_call: Optional[List[Any]] = None  # [seen storages, bytes] of the recompute call running now
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
            had_own = "activation_checkpoint_func" in vars(module)
            module.activation_checkpoint_func = self._chunk_proxy(checkpoint)
            self._undo.append(functools.partial(_restore, module, "activation_checkpoint_func", checkpoint, had_own))

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Count what autograd saves while this is open (around each schedule instruction)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def result(self) -> KeptBytes:
        layers: Dict[int, int] = {}
        outside = 0
        for kept in self._micro_batches:
            for layer, size in kept.items():
                if layer is None:
                    outside = max(outside, size)
                else:
                    layers[layer] = max(layers.get(layer, 0), size)
        return KeptBytes(layers, outside, dict(self._recompute), len(self._micro_batches))

    def _new_micro_batch(self, module, args) -> None:
        if _graph_task_id() == -1:
            self._micro_batches.append({})
            self._seen = set()

    def _layer_proxy(self, index: int, func: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args, **kwargs):
            outer, outer_call = self._layer, self._recompute_call
            self._layer = index
            if self._chunk is not None and self._chunk.first is None:
                self._chunk.first = index
            recomputing = _graph_task_id() != -1
            if recomputing:
                self._recompute_call = [set(), 0]
            try:
                return func(*args, **kwargs)
            finally:
                if recomputing:
                    self._recompute[index] = max(self._recompute.get(index, 0), self._recompute_call[1])
                self._layer, self._recompute_call = outer, outer_call
        return run

    def _chunk_proxy(self, checkpoint: Callable[..., Any]) -> Callable[..., Any]:
        def run(function, *args, **kwargs):
            outer, self._chunk = self._chunk, _Chunk()
            try:
                return checkpoint(function, *args, **kwargs)
            finally:
                chunk, self._chunk = self._chunk, outer
                if _graph_task_id() == -1:  # the checkpoint keeps its inputs till its backward
                    for tensor in chunk.saved + _tensors(args) + _tensors(list(kwargs.values())):
                        self._count(tensor, chunk.first)
        return run

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key is None or key in self._excluded:
            return tensor
        if _graph_task_id() != -1:  # saved inside backward: a checkpointed layer's recompute
            call = self._recompute_call
            if call is not None and key not in call[0]:
                call[0].add(key)
                call[1] += tensor.untyped_storage().nbytes()
            return tensor
        if self._layer is None and self._chunk is not None:
            self._chunk.saved.append(tensor)  # the chunk's, counted once its first layer is known
        else:
            self._count(tensor, self._layer)
        return tensor

    def _count(self, tensor: torch.Tensor, layer: Optional[int]) -> None:
        """A storage kept in this micro-batch, counted to `layer` (None: the stage) unless counted already."""
        key = storage_key(tensor)
        if key is None or key in self._excluded or key in self._seen or not self._micro_batches:
            return
        self._seen.add(key)
        kept = self._micro_batches[-1]
        kept[layer] = kept.get(layer, 0) + tensor.untyped_storage().nbytes()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class _Chunk:
    """A checkpointed chunk while it runs: its first layer, and what was saved in it outside its layers (a
    checkpoint may save its inputs before its first layer runs)."""
    first: Optional[int] = None
    saved: List[torch.Tensor] = field(default_factory=list)


def _tensors(values: Sequence[Any]) -> List[torch.Tensor]:
    """The tensors among `values`, in tuples and lists too."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found += _tensors(value)
    return found


def _restore(owner: object, name: str, value: object, had_own: bool) -> None:
    if had_own:
        setattr(owner, name, value)
    else:
        delattr(owner, name)
