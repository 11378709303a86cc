"""ModuleProfiler: FLOPs and latency of one module tree, split into forward, backward and recompute.

    prof = ModuleProfiler(stage_module, synchronize=get_accelerator().synchronize)
    prof.start()
    ...                    # any forward / backward / checkpoint-recompute activity
    prof.stop()
    prof.tree()            # the report schema's module node, inclusive, plus *_other_flops and *_calls
    prof.events()          # [(path, type, depth, phase, start, end)]: when each module was active, for the trace
    prof.remove()          # every hook gone: the module runs exactly as before

How it measures
- The tree (module_tree.py): one node per module (a module reachable twice appears once, each parameter
  counts once), holding every measurement, and the reported views of them: tree(), events(),
  invisible_attention().
- FLOPs (flop_counting.py): a TorchDispatchMode sees every aten op; the FLOPs of those with a formula go
  to the innermost module call on the stack, in the phase the op runs in (phases.py). Ops outside
  any call go to the root. A matrix-class op without a formula is listed by `uncounted_ops()` instead.
- Forward and recompute calls: forward pre/post hooks push and pop the stack. A call that starts
  inside an autograd graph task is a recompute (activation checkpointing), so a checkpointed layer's
  two runs per micro-batch land in different phases.
- Backward calls, without wrapping any tensor (nn.Module's full backward hooks wrap inputs and outputs
  in an identity autograd Function, which breaks in-place ops on them and warns on no-grad inputs):
  a call's backward starts when the autograd node producing one of its outputs is about to run
  (a Node pre-hook) and ends when the gradients of all its inputs that need one are computed
  (a hook on each input tensor). A call whose inputs need no gradient (an embedding fed token ids),
  or one with an input whose gradient is never computed, ends when the backward of a module outside
  its subtree starts, when its parent ends, or at the end of the graph task. Backward entries
  therefore always form a chain of ancestors. No hook holds an autograd node: a graph recorded while
  profiling and never run backward is freed as usual.
- The stack (phase_stack.py) the hooks push and pop: every entry has its tree ancestors below it in its
  phase, so children never exceed their parent; `synchronize()` then `time.perf_counter()` at every push
  and pop, and only the phase on top of the stack is timed, so the three phases never share a second.
- Backward work outside autograd: a zero-bubble schedule defers its linears' weight-gradient GEMMs out of
  the backward pass and runs them later, in its WeightPass instruction. That work is backward work of the
  linear it came from (deferred_backward, where the schedule's store hands it over) and runs as such
  (backward_outside_autograd, around the instruction).
- Events: each stretch during which a module is active in a phase is also kept as a wall-clock
  interval (phase_stack.py); events() lists those of the modules shown.
"""
import contextlib
import functools
import weakref
from typing import Any, Callable, Iterable, Iterator, List, Optional

import torch

from patches.profiler.flop_counting import FlopCountingMode, FlopCredits, UncountedOp
from patches.profiler.flop_formulas import MATRIX
from patches.profiler.module_tree import ModuleEvent, ModuleTree
from patches.profiler.phase_stack import PhaseStack
from patches.profiler.phases import BACKWARD, PHASE_PREFIXES, module_call_phase

_graph_task_id = torch._C._current_graph_task_id


class _Call:
    """One forward (or recompute) call of a module, and the backward that follows from it."""
    __slots__ = ("node", "entry", "bwd_entry", "bwd_task", "bwd_done_task", "inputs", "input_grads",
                 "pending_bwd")

    def __init__(self, node):
        self.node = node
        self.entry = self.bwd_entry = None
        self.bwd_task = self.bwd_done_task = None  # graph tasks in which the backward started / ended
        self.inputs = 0  # input tensors that need a gradient
        self.input_grads = (None, 0)  # (graph task, input gradients computed in it)
        self.pending_bwd = None  # (counter list, flops) of a module formula, credited when backward runs


class _ScopedCall:
    """fn(module, *args) run as a call of `module`: forward and backward go to the module's node.

    For DeepSpeed's TiedLayerSpec(forward_fn=...), which calls a plain function on the tied module
    so that no module hook fires.
    """
    __slots__ = ("profiler", "node", "module", "fn")

    def __init__(self, profiler, node, module, fn):
        self.profiler, self.node, self.module, self.fn = profiler, node, module, fn

    def __call__(self, *args, **kwargs):
        profiler = self.profiler
        if not profiler._counting:
            return self.fn(self.module, *args, **kwargs)
        call = profiler._enter(self.node, args, kwargs)
        output = None
        try:
            output = self.fn(self.module, *args, **kwargs)
        finally:
            profiler._exit(call, output)
        return output


class _DeferredBackward:
    """fn run as backward work of `node`, outside autograd (ModuleProfiler.deferred_backward); inside a graph
    task (run at once, within the backward it came from) it runs as it is."""
    __slots__ = ("profiler", "node", "fn")

    def __init__(self, profiler, node, fn):
        self.profiler, self.node, self.fn = profiler, node, fn

    def __call__(self, *args, **kwargs):
        profiler = self.profiler
        if not profiler._counting or _graph_task_id() != -1:
            return self.fn(*args, **kwargs)
        # whoever runs it (WeightPass, or user code), it is backward
        with profiler._stack.backward_outside_autograd(self.node):
            return self.fn(*args, **kwargs)


# The ModuleProfilers measuring now (started, not stopped): where deferred backward work is handed over.
_MEASURING = weakref.WeakSet()


def defer_backward_work(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn as each measuring profiler's deferred_backward has it: for a schedule's store of deferred
    weight-gradient work (patches.megatron_upstream wraps upstream's WeightGradStore.put with it)."""
    for profiler in list(_MEASURING):
        fn = profiler.deferred_backward(fn)
    return fn


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


class ModuleProfiler:
    def __init__(self, root: torch.nn.Module, synchronize: Optional[Callable[[], None]] = None,
                 root_name: Optional[str] = None, ignore_types: Optional[Iterable[type]] = (),
                 count_flops: bool = True):
        """ignore_types: module classes left out of the profile (DeepSpeed's ignore_list): exact types, as
        DeepSpeed matches them; the root is always kept. count_flops=False: calls and latencies only, without
        the dispatch mode on the timed path (the FLOPs come from another pass: adopt_counts)."""
        self.root_module = root
        self._tree = ModuleTree(root, root_name or type(root).__name__, ignore_types)
        self._stack = PhaseStack(self._tree.nodes, synchronize)
        self._push, self._pop = self._stack.push, self._stack.pop  # bound once: every hook pushes or pops
        self._credits = FlopCredits(self._tree.root, self._stack)
        self._mode = FlopCountingMode(self._credits.credit, self._credits.count_uncounted,
                                      self._credits.note_value_dependent) if count_flops else None
        self._module_hooks = []
        self._graph_hooks = []  # hooks on autograd nodes and tensors made while profiling
        self._watched_tasks = set()
        self._counting = False

    # ------------------------------------------------------------------ public API
    def start(self) -> None:
        if self._counting:
            return
        if not self._module_hooks:
            for module, node in self._tree.pairs:
                self._module_hooks.append(module.register_forward_pre_hook(
                    functools.partial(self._on_forward_pre, node), with_kwargs=True, prepend=True))
                self._module_hooks.append(module.register_forward_hook(
                    functools.partial(self._on_forward_post, node), always_call=True))
        self._stack.clear()
        self._forget_open_calls()
        if self._mode is not None:
            self._mode.__enter__()
        self._counting = True
        _MEASURING.add(self)

    def stop(self) -> None:
        """Stop counting; counts stay readable. Hooks stay installed but do nothing until start()."""
        if not self._counting:
            return
        self._counting = False
        _MEASURING.discard(self)
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
        self._stack.clear()
        self._forget_open_calls()

    def remove(self) -> None:
        """Remove every hook this profiler added, on modules and on autograd graphs still alive."""
        self.stop()
        for handle in self._module_hooks + self._graph_hooks:
            handle.remove()
        self._module_hooks, self._graph_hooks = [], []

    def reset(self) -> None:
        self._tree.zero_counts()
        self._stack.restart_clocks()
        self._credits.reset()

    def tree(self) -> dict:
        return self._tree.as_dict()

    def events(self) -> List[ModuleEvent]:
        """[(path, type, depth, phase, start, end)] in order of ending: every stretch during which a module
        had a call running in a phase ('fwd', 'bwd' or 'recompute'), in perf_counter seconds. The same
        string objects repeat for a module, so pickling the list sends each path once."""
        return self._tree.events(self._stack.stretches)

    def uncounted_ops(self) -> List["UncountedOp"]:
        """[UncountedOp] seen while counting, sorted by (op, phase): matrix-class aten ops without a formula."""
        return self._credits.uncounted_ops()

    def invisible_attention(self) -> List[dict]:
        """[{module, type, calls}]: the deepest modules whose type names attention (Attention, Attn) that ran
        forward calls in which no matrix work was counted, in their subtree either (modules left out by
        ignore_list excepted). Attention that reaches torch (SDPA, bmm, flash-attn's custom ops) always is, so
        such a module ran a kernel torch cannot see, and its attention FLOPs are missing."""
        return self._tree.invisible_attention()

    def totals(self) -> dict:
        tree = self.tree()
        return {f"{prefix}_flops": tree[f"{prefix}_flops"] for prefix in PHASE_PREFIXES}

    def adopt_counts(self, counter: "ModuleProfiler") -> List[str]:
        """Take the FLOPs (and uncounted ops) of `counter`, a counting pass over the same module tree in
        another iteration, keeping this profiler's calls and latencies. Returns the modules whose calls
        differ between the two passes: "path: phase counted/timed" for the number of calls, "path: phase
        input shapes" for the same number with other input shapes, and the modules whose counted FLOPs
        depend on tensor values (flash-attn's varlen ops), which no comparison of calls can vouch for; empty
        when the same calls ran and their FLOPs follow from their shapes."""
        differ = self._tree.adopt_flops(counter._tree)
        return differ + self._credits.adopt(counter._credits)

    @contextlib.contextmanager
    def backward_outside_autograd(self) -> Iterator[None]:
        """Backward work a pipeline schedule runs outside autograd (a zero-bubble schedule's WeightPass: the
        weight-gradient GEMMs deferred out of the backward pass). Its ops count as backward; they go to the
        module whose deferred work runs (deferred_backward), else to the root, whose backward latency covers
        the whole of it."""
        if not self._counting or self._stack.outside_autograd:
            yield
            return
        with self._stack.backward_outside_autograd(self._tree.root):
            yield

    def deferred_backward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn, handed out of the backward of the module running it now (the top of the stack), to be run later
        as that module's backward work: upstream's WeightGradStore defers the weight-gradient GEMM of each
        parallel linear this way. Outside a module's backward, fn itself."""
        entries = self._stack.entries
        if not self._counting or not entries or entries[-1].phase != BACKWARD:
            return fn
        return _DeferredBackward(self, entries[-1].node, fn)

    def scoped_call(self, module: torch.nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A callable: proxy(*args) runs fn(module, *args) as a call of `module` (forward and backward)."""
        node = self._tree.node_of(module)
        if node is None:
            raise ValueError(f"scoped_call: {type(module).__name__} is not in the profiled module tree")
        return _ScopedCall(self, node, module, fn)

    def _forget_open_calls(self):
        for node in self._tree.nodes:
            node.open_calls.clear()

    # ------------------------------------------------------------------ forward / recompute calls
    def _on_forward_pre(self, node, module, args, kwargs):
        if self._counting:
            self._enter(node, args, kwargs)

    def _on_forward_post(self, node, module, args, output):
        if not self._counting or not node.open_calls:
            return
        call = node.open_calls[-1]
        self._exit(call, output)
        if node.formula is not None and output is not None:
            self._count_module_formula(node, call, module, args, output)

    def _enter(self, node, args, kwargs):
        call = _Call(node)
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
        # What adopt_counts compares between two iterations, beside the calls: a change of shape (a growing
        # sequence length) changes the FLOPs with the same calls.
        node.input_shapes[phase] = hash((node.input_shapes[phase], tuple(map(_shape_key, tensors))))
        node.open_calls.append(call)
        return call

    def _exit(self, call, output):
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

    def _count_module_formula(self, node, call, module, args, output):
        formula = node.formula
        counter = node.flops if formula.kind == MATRIX else node.other_flops
        forward = formula.forward(module, args, output)
        counter[call.entry.phase] += forward
        if torch.is_grad_enabled():
            call.pending_bwd = (counter, formula.backward(module, args, output, forward))

    # ------------------------------------------------------------------ backward calls
    def _on_outputs_grad(self, call, grad_outputs):
        if not self._counting:
            return
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
        if not self._counting:
            return
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
        if self._counting:
            self._stack.close_task(task)
