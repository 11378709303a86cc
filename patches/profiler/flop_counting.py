"""FLOPs of every aten op, credited to the module running it, in the phase the op runs in.

- A TorchDispatchMode (FlopCountingMode) sees every aten op. Ops in `torch.utils.flop_counter`'s registry
  (GEMMs, convolutions, attention; see flop_formulas.py for the CPU attention kernels added to it) are
  counted, others cost one dict lookup (the formula cache). Each counted op goes to the innermost module call
  on the phase stack (phase_stack.py), in the phase the op runs in (PhaseStack.op_phase). Ops outside any
  call go to the root.
- aten.mul.Tensor counts only inside the backward of mv / addmv / dot / vdot, where it forms a GEMM
  gradient (flop_formulas.gemm_backward_product_flops).
- A matrix-class op without a formula, or one given a nested tensor, is listed by `uncounted_ops()` instead:
  a total is never silently smaller than the work done.
- Under inference_mode, composite ops (linear, matmul, einsum, conv2d) reach the mode whole; they run as their
  decomposition, whose ops are counted, so the count does not depend on the grad mode.
"""
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from patches.profiler.flop_formulas import (
    VALUE_DEPENDENT_FORMULAS,
    any_nested,
    custom_op_formula,
    gemm_backward_product_flops,
    is_matrix_class,
)
from patches.profiler.module_tree import ModuleNode
from patches.profiler.phase_names import PHASE_PREFIXES
from patches.profiler.phase_stack import PhaseStack


@dataclass(frozen=True)
class UncountedOp:
    """An aten op that may do matrix-class work but has no FLOP formula: listed in the report, so a
    total is never silently smaller than the work done."""
    op: str  # the overload's name, e.g. "aten.mv.default"
    phase: str  # "fwd", "bwd" or "recompute"
    calls: int


# The formula cache's values beyond formulas and None: a matrix-class op without a formula (counted as
# a call, not as FLOPs), and a composite op to run as its decomposition (below).
UNCOUNTED = object()
DECOMPOSE = object()


# The code of torch's shape_wrapper, which every formula registered without get_raw carries.
_SHAPE_WRAPPER_CODE = flop_counter.shape_wrapper(lambda: None).__code__


class _Unshaped(Exception):
    """An argument in a container other than list, tuple or dict: left to torch's own shape wrapper."""


def _shape_of(value):
    """What torch's shape_wrapper hands a formula for `value` (tensors replaced by their shapes), without
    its pytree flatten and unflatten, which cost more than the rest of a counted op."""
    if isinstance(value, torch.Tensor):
        return value.shape
    kind = type(value)
    if kind is list or kind is tuple:
        return kind(_shape_of(item) for item in value)
    if kind is dict:
        return {key: _shape_of(item) for key, item in value.items()}
    if isinstance(value, tuple) and kind is not torch.Size:  # named tuples: pytree rebuilds them
        raise _Unshaped
    return value


class _ShapeFormula:
    """A registered formula called on shapes directly: the same function, so the same count."""
    __slots__ = ("wrapped", "raw")

    def __init__(self, wrapped):
        self.wrapped, self.raw = wrapped, wrapped.__wrapped__

    def __call__(self, *args, out_val=None, **kwargs):
        try:
            return self.raw(*_shape_of(args), out_shape=_shape_of(out_val), **_shape_of(kwargs))
        except _Unshaped:
            return self.wrapped(*args, out_val=out_val, **kwargs)


class _FormulaCache(dict):
    """aten overload -> torch's FLOP formula for its packet, UNCOUNTED, DECOMPOSE or None: one dict lookup
    per op."""

    def __missing__(self, func):
        packet = getattr(func, "_overloadpacket", None)
        formula = flop_counter.flop_registry.get(packet)
        if getattr(formula, "__code__", None) is _SHAPE_WRAPPER_CODE:
            formula = _ShapeFormula(formula)
        if func is torch.ops.aten.mul.Tensor:  # the outer products of mv's and dot's backward
            formula = gemm_backward_product_flops
        if formula is None:
            formula = custom_op_formula(func)
        if formula is None and _has_composite_kernel(func):
            formula = DECOMPOSE
        elif formula is None and packet is not None and is_matrix_class(packet.__name__):
            formula = UNCOUNTED
        self[func] = formula
        return formula


def _has_composite_kernel(func):
    """Under inference_mode, composite ops (linear, matmul, einsum, conv2d) reach the mode whole instead of
    as the mm / bmm / convolution they run as; their decomposition runs the same kernels (torch's own
    FlopCounterMode decomposes them too), so the count does not depend on the grad mode."""
    if not isinstance(func, torch._ops.OpOverload):  # higher-order ops have no dispatcher entry
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


class FlopCountingMode(TorchDispatchMode):
    """Runs every aten op, and hands what it counted to three callables: credit(flops) for an op with a
    formula, uncounted(func) for a matrix-class op without one (or whose formula raised on its arguments: the
    op still runs, once, as it would), value_dependent(func) for an op whose FLOPs read tensor values. Plain
    bound methods, called directly: this is the profiler's per-op path."""

    @classmethod
    def _should_skip_dynamo(cls):
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless the mode opts out (its
        # documented opt-out): that wrapper alone doubled the per-op cost. Nothing here is compiled.
        return False

    def __init__(self, credit: Callable[[int], None], uncounted: Callable[[Any], None],
                 value_dependent: Callable[[Any], None]):
        super().__init__()
        self.formulas = _FormulaCache()
        self.credit = credit
        self.uncounted = uncounted
        self.value_dependent = value_dependent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        formula = self.formulas[func]
        if formula is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        # A nested tensor (TransformerEncoder's padding-mask fast path) has no sizes for a formula to read,
        # and composite decompositions do not run on it: its matrix-class ops are listed as uncounted.
        nested = any_nested(args)
        if formula is DECOMPOSE:
            if not nested:
                with self:  # the decomposition's ops come back here to be counted
                    out = func.decompose(*args, **(kwargs or {}))
                if out is not NotImplemented:
                    return out
            formula = UNCOUNTED if nested and is_matrix_class(func._overloadpacket.__name__) else None
        elif nested:
            formula = None if formula is gemm_backward_product_flops else UNCOUNTED
        out = func(*args, **kwargs) if kwargs else func(*args)
        if formula is UNCOUNTED:
            self.uncounted(func)
        elif formula is not None:
            try:
                flops = formula(*args, **kwargs, out_val=out) if kwargs else formula(*args, out_val=out)
            except Exception:  # a formula that cannot read these arguments: the op is listed, never the run's end
                self.uncounted(func)
                return out
            if flops:
                self.credit(flops)
            if formula in VALUE_DEPENDENT_FORMULAS:
                self.value_dependent(func)
        return out


class FlopCredits:
    """Where the mode's counts go: each op's FLOPs to the node on top of the phase stack (the root when the
    stack is empty), in the op's phase; the ops it could not count, and the modules where FLOPs read tensor
    values, kept aside for the report."""

    def __init__(self, root: ModuleNode, stack: PhaseStack):
        self._root = root
        # Bound once: credit runs on every counted op, and the stack never rebinds its entries.
        self._entries = stack.entries
        self._op_phase = stack.op_phase
        self._uncounted: Dict[Tuple[str, int], int] = {}  # (op name, phase) -> calls
        self._value_dependent: Dict[str, str] = {}  # "path: phase" -> the op whose FLOPs read tensor values there

    def credit(self, flops: int) -> None:
        entries = self._entries
        node = entries[-1].node if entries else self._root
        node.flops[self._op_phase()] += flops

    def count_uncounted(self, func: Any) -> None:
        key = (str(func), self._op_phase())
        self._uncounted[key] = self._uncounted.get(key, 0) + 1

    def note_value_dependent(self, func: Any) -> None:
        node = self._entries[-1].node if self._entries else self._root
        self._value_dependent[f"{node.path}: {PHASE_PREFIXES[self._op_phase()]}"] = str(func)

    def uncounted_ops(self) -> List[UncountedOp]:
        """[UncountedOp] seen while counting, sorted by (op, phase): matrix-class aten ops without a formula."""
        return [UncountedOp(op=op, phase=PHASE_PREFIXES[phase], calls=calls)
                for (op, phase), calls in sorted(self._uncounted.items())]

    def reset(self) -> None:
        self._uncounted = {}
        self._value_dependent = {}

    def adopt(self, counted: "FlopCredits") -> List[str]:
        """Take the uncounted ops of `counted`, another pass's credits; returns one line per module whose
        counted FLOPs depend on tensor values (flash-attn's varlen ops: the same shapes do not mean the same
        FLOPs there), which no comparison of calls can vouch for."""
        self._uncounted = dict(counted._uncounted)
        return [f"{where} FLOPs of {op} depend on tensor values, not shapes alone"
                for where, op in sorted(counted._value_dependent.items())]
