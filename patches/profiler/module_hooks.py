"""When each module call starts and ends, in each phase: the hooks that push and pop the phase stack.

- Forward and recompute calls: forward pre/post hooks push and pop the stack. A call that starts
  inside an autograd graph task is a recompute (activation checkpointing), so a checkpointed layer's
  two runs per micro-batch land in different phases.
- Backward calls, without wrapping any tensor (nn.Module's full backward hooks wrap inputs and outputs
  in an identity autograd Function, which breaks in-place ops on them and warns on no-grad inputs):
  a call's backward starts when the autograd node producing one of its outputs is about to run
  (a Node pre-hook) and ends when the gradients of all its inputs that need one are computed
  (a hook on each input tensor). A call whose inputs need no gradient (an embedding fed token ids),
  or one with an input whose gradient is never computed, ends when the backward of a module outside
  its subtree starts, when its parent ends, or at the end of the graph task (a callback queued on the
  autograd engine). Backward entries therefore always form a chain of ancestors. No hook holds an
  autograd node: a graph recorded while profiling and never run backward is freed as usual.
- Module formulas (module_flops.register_module_flops, for kernels that bypass aten): the forward FLOPs
  are counted when the call ends, the backward's when its backward starts, once per graph task.
- Calls no hook sees: a function run on a module (DeepSpeed's TiedLayerSpec forward_fn) runs as a call of
  that module (scoped_call); backward work a schedule hands out of the backward pass, to run later outside
  autograd (a zero-bubble schedule's deferred weight-gradient GEMMs), runs as backward of the module it came
  from (deferred_backward).
- Per call: what adopt_counts compares between two iterations, the number of calls per phase and a hash
  of their input shapes (a change of shape, a growing sequence length, changes the FLOPs with the same calls).
"""
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from patches.profiler.fail_safe import error_line
from patches.profiler.module_flops import MATRIX
from patches.profiler.module_tree import ModuleNode
from patches.profiler.phase_stack import Entry, PhaseStack
from patches.profiler.phases import BACKWARD, module_call_phase

_graph_task_id = torch._C._current_graph_task_id


class ModuleCall:
    """One forward (or recompute) call of a module, and the backward that follows from it."""
    __slots__ = ("node", "entry", "bwd_entry", "bwd_task", "bwd_done_task", "inputs", "input_grads",
                 "pending_bwd")

    def __init__(self, node: ModuleNode):
        self.node = node
        self.entry: Optional[Entry] = None
        self.bwd_entry: Optional[Entry] = None
        self.bwd_task = self.bwd_done_task = None  # graph tasks in which the backward started / ended
        self.inputs = 0  # input tensors that need a gradient
        self.input_grads = (None, 0)  # (graph task, input gradients computed in it)
        self.pending_bwd = None  # (counter list, flops) of a module formula, credited when backward runs


class ModuleHooksFailed(RuntimeError):
    """A hook of the module profiler raised (its first error, where): what it measured cannot be reported."""


class ModuleHooks:
    """The forward hooks of every module of the tree, and the autograd hooks they place while measuring.

    `measuring` is False between stop() and start(): every hook then returns at once. A hook that raises does
    not raise into the user's forward or backward: measuring stops, and `failure` says where and why (the
    module profiler's results raise it, so that no report is built of what was half measured)."""

    def __init__(self, pairs: List[Tuple[torch.nn.Module, ModuleNode]], stack: PhaseStack):
        self._pairs = pairs
        self._stack = stack
        # Bound once: every hook pushes or pops.
        self._push, self._pop = stack.push, stack.pop
        self.measuring = False
        self._module_hooks = []
        self._graph_hooks = []  # hooks on autograd nodes and tensors made while measuring
        self._watched_tasks = set()  # graph tasks with an end callback queued
        self.failure: Optional[str] = None  # the first hook's error, where it happened

    def start(self) -> None:
        """Install the module hooks (once) and measure every call from now on."""
        if not self._module_hooks:
            for module, node in self._pairs:
                self._module_hooks.append(module.register_forward_pre_hook(
                    functools.partial(self._on_forward_pre, node), with_kwargs=True, prepend=True))
                self._module_hooks.append(module.register_forward_hook(
                    functools.partial(self._on_forward_post, node), always_call=True))
        self._forget_open_calls()
        self.measuring = True

    def stop(self) -> None:
        """Every hook inert until start(); calls still open are forgotten."""
        self.measuring = False
        self._forget_open_calls()

    def remove(self) -> None:
        """Remove every hook, on modules and on autograd graphs still alive."""
        for handle in self._module_hooks + self._graph_hooks:
            handle.remove()
        self._module_hooks, self._graph_hooks = [], []

    def enter(self, node: ModuleNode, args: tuple, kwargs: Dict[str, Any]) -> ModuleCall:
        """A call of `node`'s module starts now (its forward pre-hook)."""
        call = ModuleCall(node)
        tensors = _tensors((args, kwargs), [])
        if torch.is_grad_enabled():
            on_input_grad = functools.partial(self._on_input_grad, call)
            for tensor in tensors:
                if tensor.requires_grad:
                    call.inputs += 1
                    self._graph_hooks.append(tensor.register_hook(on_input_grad))
        phase = module_call_phase()
        call.entry = self._push(node, phase)
        node.calls[phase] += 1
        node.input_shapes[phase] = hash((node.input_shapes[phase], tuple(map(_shape_key, tensors))))
        node.open_calls.append(call)
        return call

    def exit(self, call: ModuleCall, output: Any) -> None:
        """`call` returned `output` (None if it raised); its backward starts when an output's node runs."""
        node = call.node
        if call not in node.open_calls:  # profiling stopped or restarted during the call
            return
        node.open_calls.remove(call)
        self._pop(call.entry)
        if output is None or not torch.is_grad_enabled():
            return
        on_outputs_grad = functools.partial(self._on_outputs_grad, call)
        for grad_fn in _output_nodes(output):
            self._graph_hooks.append(grad_fn.register_prehook(on_outputs_grad))

    def scoped_call(self, node: ModuleNode, module: torch.nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
        """proxy(*args) runs fn(module, *args) as a call of `node` (forward and backward)."""
        return _ScopedCall(self, node, module, fn)

    def deferred_backward(self, node: ModuleNode, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn, to be run later outside autograd as backward work of `node`."""
        return _DeferredBackward(self, self._stack, node, fn)

    def _forget_open_calls(self):
        for _, node in self._pairs:
            node.open_calls.clear()

    # ------------------------------------------------------------------ forward / recompute calls
    def fail(self, where: str, error: Exception) -> None:
        """A hook raised: every hook inert from now on, the first error kept."""
        self.measuring = False
        if self.failure is None:
            self.failure = f"the module profiler's {where} raised {error_line(error)}"

    def _on_forward_pre(self, node, module, args, kwargs):
        if self.measuring:
            try:
                self.enter(node, args, kwargs)
            except Exception as error:
                self.fail(f"forward pre-hook of {node.path}", error)

    def _on_forward_post(self, node, module, args, output):
        if not self.measuring or not node.open_calls:
            return
        try:
            call = node.open_calls[-1]
            self.exit(call, output)
            if node.formula is not None and output is not None:
                self._count_module_formula(node, call, module, args, output)
        except Exception as error:
            self.fail(f"forward hook of {node.path}", error)

    def _count_module_formula(self, node, call, module, args, output):
        formula = node.formula
        counter = node.flops if formula.kind == MATRIX else node.other_flops
        forward = formula.forward(module, args, output)
        counter[call.entry.phase] += forward
        if torch.is_grad_enabled():
            call.pending_bwd = (counter, formula.backward(module, args, output, forward))

    # ------------------------------------------------------------------ backward calls
    def _on_outputs_grad(self, call, grad_outputs):
        if not self.measuring:
            return
        try:
            self._backward_starts(call)
        except Exception as error:
            self.fail(f"backward hook of {call.node.path}", error)

    def _backward_starts(self, call):
        task = _graph_task_id()
        if call.bwd_done_task == task or (call.bwd_entry is not None and call.bwd_entry.live):
            return  # an identity module (its inputs' gradients came first), or already running
        call.bwd_entry = self._push(call.node, BACKWARD)
        if call.bwd_task != task:
            call.bwd_task = task
            call.node.calls[BACKWARD] += 1
            if call.pending_bwd is not None:
                counter, flops = call.pending_bwd
                counter[BACKWARD] += flops
        if task not in self._watched_tasks:
            self._watched_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._on_task_end, task))

    def _on_input_grad(self, call, grad):
        if not self.measuring:
            return
        try:
            self._input_gradient(call)
        except Exception as error:
            self.fail(f"input-gradient hook of {call.node.path}", error)

    def _input_gradient(self, call):
        task = _graph_task_id()
        seen_task, count = call.input_grads
        count = count + 1 if seen_task == task else 1
        call.input_grads = (task, count)
        if count < call.inputs:
            return
        call.bwd_done_task = task
        if call.bwd_entry is not None and call.bwd_entry.live:
            self._pop(call.bwd_entry)

    def _on_task_end(self, task):
        """End of a graph task (a backward call, or a reentrant checkpoint's inner backward)."""
        self._watched_tasks.discard(task)
        if self.measuring:
            try:
                self._stack.close_task(task)
            except Exception as error:
                self.fail("end-of-backward callback", error)


class _ScopedCall:
    """fn(module, *args) run as a call of `module`: forward and backward go to the module's node.

    For DeepSpeed's TiedLayerSpec(forward_fn=...), which calls a plain function on the tied module
    so that no module hook fires.
    """
    __slots__ = ("hooks", "node", "module", "fn")

    def __init__(self, hooks, node, module, fn):
        self.hooks, self.node, self.module, self.fn = hooks, node, module, fn

    def __call__(self, *args, **kwargs):
        hooks = self.hooks
        if not hooks.measuring:
            return self.fn(self.module, *args, **kwargs)
        try:
            call = hooks.enter(self.node, args, kwargs)
        except Exception as error:
            hooks.fail(f"call of {self.node.path}", error)
            return self.fn(self.module, *args, **kwargs)
        output = None
        try:
            output = self.fn(self.module, *args, **kwargs)
        finally:
            try:
                hooks.exit(call, output)
            except Exception as error:
                hooks.fail(f"call of {self.node.path}", error)
        return output


class _DeferredBackward:
    """fn run as backward work of `node`, outside autograd (ModuleProfiler.deferred_backward); inside a graph
    task (run at once, within the backward it came from) it runs as it is. Whoever runs it (WeightPass, or
    user code), it is backward work."""
    __slots__ = ("hooks", "stack", "node", "fn")

    def __init__(self, hooks, stack, node, fn):
        self.hooks, self.stack, self.node, self.fn = hooks, stack, node, fn

    def __call__(self, *args, **kwargs):
        if not self.hooks.measuring or _graph_task_id() != -1:
            return self.fn(*args, **kwargs)
        with self.stack.backward_outside_autograd(self.node):
            return self.fn(*args, **kwargs)


def _tensors(value, found):
    """Append the tensors of nested tuples, lists and dicts to `found`."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


def _shape_key(tensor):
    """A tensor's shape for comparing two iterations' calls; a nested tensor has no sizes to read."""
    return ("nested", tensor.dim()) if tensor.is_nested else tuple(tensor.shape)


def _output_nodes(output):
    """The autograd nodes whose running means a call's backward has begun: each output's grad_fn and,
    for an output that is a view, its base's grad_fn (an in-place op on the view, e.g. by the caller,
    swaps the view's node out of the graph; the base's node stays in it)."""
    nodes = {}
    for tensor in _tensors(output, []):
        for source in (tensor, tensor._base):
            if source is not None and source.grad_fn is not None:
                nodes[id(source.grad_fn)] = source.grad_fn
    return nodes.values()
