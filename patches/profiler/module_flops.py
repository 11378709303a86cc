"""Per-module FLOP formulas, for modules whose kernels never reach the aten dispatcher (apex's fused layer norm,
Megatron's fused softmax, RMSNorm, rotary embeddings), so that no dispatch mode sees them: registered by class
or class name, and read by each module profiler when it is built (module_tree.py). Same conventions as
flop_formulas.py (docs/profiling.md)."""
from typing import Any, Callable, Optional, Union

import torch

ModuleFlopsFn = Callable[[torch.nn.Module, tuple, Any], int]  # (module, inputs, output) -> flops

MATRIX, OTHER = "matrix", "other"


class ModuleFlops:
    """How to count one module call: forward = fn(module, inputs, output).

    Backward = bwd_fn(module, inputs, output) when given, else round(bwd_factor * forward). It is
    credited when that call's backward actually runs. kind 'matrix' counts into fwd/bwd/recompute_flops,
    kind 'other' into fwd/bwd/recompute_other_flops. These formulas add to what the aten dispatch mode
    sees inside the module, so only register modules whose kernels bypass aten.
    """
    __slots__ = ("fn", "kind", "bwd_fn", "bwd_factor")

    def __init__(self, fn: ModuleFlopsFn, kind: str, bwd_fn: Optional[ModuleFlopsFn] = None,
                 bwd_factor: float = 2.0):
        if kind not in (MATRIX, OTHER):
            raise ValueError(f"kind must be {MATRIX!r} or {OTHER!r}, got {kind!r}")
        self.fn, self.kind, self.bwd_fn, self.bwd_factor = fn, kind, bwd_fn, bwd_factor

    def forward(self, module: torch.nn.Module, inputs: tuple, output: Any) -> int:
        return int(self.fn(module, inputs, output))

    def backward(self, module: torch.nn.Module, inputs: tuple, output: Any, forward_flops: int) -> int:
        if self.bwd_fn is not None:
            return int(self.bwd_fn(module, inputs, output))
        return int(round(self.bwd_factor * forward_flops))


_MODULE_FLOPS = {}


def register_module_flops(module_type_or_name: Union[type, str], fn: Callable, kind: str = OTHER, *,
                          bwd_fn: Optional[Callable] = None, bwd_factor: float = 2.0) -> None:
    """Count calls of a module class (a type, or a class name for classes that may not import).

    A module matches the first class of its MRO registered by type or by name, so subclasses inherit
    the entry (e.g. apex's MixedFusedLayerNorm, a FusedLayerNorm). A profiler reads the registry
    when it is constructed.
    """
    _MODULE_FLOPS[module_type_or_name] = ModuleFlops(fn, kind, bwd_fn, bwd_factor)


def module_flops_for(module: torch.nn.Module) -> Optional["ModuleFlops"]:
    for cls in type(module).__mro__:
        entry = _MODULE_FLOPS.get(cls) or _MODULE_FLOPS.get(cls.__name__)
        if entry is not None:
            return entry
    return None


def _first_tensor(inputs):
    for value in inputs:
        if isinstance(value, torch.Tensor):
            return value
    return None


def layer_norm_flops(module: torch.nn.Module, inputs: tuple, output: Any) -> int:
    """Per element: mean (1), centre (1), square (1), variance (1), normalise (1); affine adds 2."""
    x = _first_tensor(inputs)
    if x is None:
        return 0
    per_element = 7 if getattr(module, "elementwise_affine", True) else 5
    return per_element * x.numel()


def scale_mask_softmax_flops(module: torch.nn.Module, inputs: tuple, output: Any) -> int:
    """Per score: scale (1), mask (1), max (1), subtract (1), exp (1), sum (1), divide (1)."""
    x = _first_tensor(inputs)
    return 0 if x is None else 7 * x.numel()


def rms_norm_flops(module: torch.nn.Module, inputs: tuple, output: Any) -> int:
    """Per element: square (1), mean (1), normalise (1); the weight adds 1. Per-row work (+eps, rsqrt) is
    left out, as layer_norm_flops leaves it out."""
    x = _first_tensor(inputs)
    if x is None:
        return 0
    return (4 if getattr(module, "weight", None) is not None else 3) * x.numel()


def rotary_embedding_flops(module: torch.nn.Module, inputs: tuple, output: Any) -> int:
    """x * cos + rotate_half(x) * sin on the first `module.dim` channels of each head: 3 per rotated element
    (the sign flip and the angle table are not counted). Backward, grad * cos + rotate_half^T(grad * sin), is
    the same 3 per element."""
    x = _first_tensor(inputs)
    rotated = getattr(module, "dim", None)
    if x is None or not isinstance(rotated, int) or x.dim() == 0 or x.shape[-1] == 0:
        return 0  # e.g. upstream Megatron's RotaryEmbedding(max_seq_len), which only builds the angle table
    return 3 * (x.numel() // x.shape[-1]) * min(rotated, x.shape[-1])


# apex is never installed here: match its classes (and Megatron's fused softmax) by name. torch's
# LayerNorm gets the same entry so a model reports the same numbers with and without apex.
for _name in ("FusedLayerNorm", "MixedFusedLayerNorm"):
    register_module_flops(_name, layer_norm_flops, OTHER)
register_module_flops(torch.nn.LayerNorm, layer_norm_flops, OTHER)
register_module_flops("FusedScaleMaskSoftmax", scale_mask_softmax_flops, OTHER)
# RMSNorm by name: torch.nn.RMSNorm and megatron/model's RMSNorm (this fork's and upstream's), apex's fused one.
for _name in ("RMSNorm", "FusedRMSNorm", "MixedFusedRMSNorm"):
    register_module_flops(_name, rms_norm_flops, OTHER)
# megatron/model/rotary.py's RotaryEmbedding, which applies the rotation to a [.., seq, head_dim] tensor.
register_module_flops("RotaryEmbedding", rotary_embedding_flops, OTHER, bwd_factor=1.0)
