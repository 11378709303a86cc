"""ModuleProfiler: FLOPs and latency of one module tree, split into forward, backward and recompute.

    prof = ModuleProfiler(stage_module, synchronize=get_accelerator().synchronize)
    prof.start()
    ...                    # any forward / backward / checkpoint-recompute activity
    prof.stop()
    prof.tree()            # the report schema's module node, inclusive, plus *_other_flops and *_calls
    prof.events()          # [(path, type, depth, phase, start, end)]: when each module was active, for the trace
    prof.remove()          # every hook gone: the module runs exactly as before

    results = prof.finish(adopt_from=counting_pass)   # stop, adopt, remove and results() in one call

How it measures, one part per file (each file's docstring says how):
- module_tree.py: one node per module (a module reachable twice appears once, each parameter counts once),
  holding every measurement, and the reported views of them: tree(), events(), invisible_attention().
- flop_counting.py: a TorchDispatchMode sees every aten op; the FLOPs of those with a formula go to the
  innermost module call on the stack, in the phase the op runs in (phases.py); ops outside any call go to
  the root. A matrix-class op without a formula is listed by `uncounted_ops()` instead.
- module_hooks.py: forward pre/post hooks time forward and recompute calls (a call starting inside an
  autograd graph task is a recompute); autograd Node pre-hooks and input-tensor hooks time backward calls
  without wrapping any tensor; calls no hook sees (scoped_call, deferred_backward) are timed alike.
- phase_stack.py: the stack the hooks push and pop; every entry has its tree ancestors below it in its
  phase, so children never exceed their parent; `synchronize()` then `time.perf_counter()` at every push and
  pop, and only the phase on top of the stack is timed, so the three phases never share a second. Each
  stretch of a module's activity in a phase is also kept as a wall-clock interval (events()).
- gc_pauses.py: Python's garbage collections while measuring; their pauses are left out of every latency
  (no module's work) and summed by themselves (results().gc).
- Backward work outside autograd: a zero-bubble schedule defers its linears' weight-gradient GEMMs out of
  the backward pass and runs them later, in its WeightPass instruction. That work is backward work of the
  linear it came from (deferred_backward, where the schedule's store hands it over) and runs as such
  (backward_outside_autograd, around the instruction).
"""
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, List, Optional

import torch

from patches.profiler.flop_counting import FlopCountingMode, FlopCredits, UncountedOp
from patches.profiler.gc_pauses import GcPauses, GcSummary
from patches.profiler.module_hooks import ModuleHooks, ModuleHooksFailed
from patches.profiler.module_tree import ModuleEvent, ModuleTree
from patches.profiler.phase_names import PHASE_PREFIXES
from patches.profiler.phase_stack import PhaseStack
from patches.profiler.phases import BACKWARD

# UncountedOp and ModuleEvent live with the parts that make them; readers of the profiler import them here.
__all__ = ("ModuleEvent", "ModuleProfiler", "ModuleResults", "UncountedOp")


@dataclass(frozen=True)
class ModuleResults:
    """What a profiler measured, read at once (ModuleProfiler.results)."""
    tree: dict  # tree()
    uncounted_ops: List[UncountedOp]  # uncounted_ops()
    invisible_attention: List[dict]  # invisible_attention()
    calls_differ: List[str] = field(default_factory=list)  # adopt_counts(), where finish() adopted a pass
    gc: GcSummary = field(default_factory=GcSummary)  # the collector's pauses, left out of every latency


class ModuleProfiler:
    """The parts composed over one module tree: started, stopped and read as one."""

    def __init__(self, root: torch.nn.Module, synchronize: Optional[Callable[[], None]] = None,
                 root_name: Optional[str] = None, ignore_types: Optional[Iterable[type]] = (),
                 count_flops: bool = True):
        """ignore_types: module classes left out of the profile (DeepSpeed's ignore_list): exact types, as
        DeepSpeed matches them; the root is always kept. count_flops=False: calls and latencies only, without
        the dispatch mode on the timed path (the FLOPs come from another pass: adopt_counts)."""
        self.root_module = root
        self._tree = ModuleTree(root, root_name or type(root).__name__, ignore_types)
        self.gc_pauses = GcPauses(before_pause=synchronize)
        self._stack = PhaseStack(self._tree.nodes, synchronize, self.gc_pauses)
        self._credits = FlopCredits(self._tree.root, self._stack)
        self._mode = FlopCountingMode(self._credits.credit, self._credits.count_uncounted,
                                      self._credits.note_value_dependent) if count_flops else None
        self._hooks = ModuleHooks(self._tree.pairs, self._stack)
        # Its own, not the hooks' `measuring`: a hook that fails stops them, and the dispatch mode and the garbage
        # collector's callback must still come off at stop().
        self._running = False

    @classmethod
    def started(cls, root: torch.nn.Module, **options: Any) -> "ModuleProfiler":
        """A profiler over `root` (the constructor's options), measuring from now on."""
        profiler = cls(root, **options)
        profiler.start()
        return profiler

    def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._stack.clear()
        self.gc_pauses.clear()
        self.gc_pauses.watch()
        if self._mode is not None:
            self._mode.__enter__()
        self._hooks.start()

    def stop(self, adopt_from: Optional["ModuleProfiler"] = None) -> List[str]:
        """Stop counting; counts stay readable. Hooks stay installed but do nothing until start(). adopt_from: a
        counting pass whose FLOPs to take (adopt_counts, whose list of calls that differ is returned; [] without)."""
        if self._running:
            self._running = False
            self._hooks.stop()
            self.gc_pauses.unwatch()
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
            self._stack.clear()
        return self.adopt_counts(adopt_from) if adopt_from is not None else []

    def remove(self) -> None:
        """Remove every hook this profiler added, on modules and on autograd graphs still alive."""
        self.stop()
        self._hooks.remove()

    def finish(self, adopt_from: Optional["ModuleProfiler"] = None) -> ModuleResults:
        """The profiler's end: stop(adopt_from), remove(), and what it measured (results()), with the calls that
        differ from the adopted counting pass's."""
        calls_differ = self.stop(adopt_from)
        self.remove()
        measured = self.results()
        return ModuleResults(measured.tree, measured.uncounted_ops, measured.invisible_attention, calls_differ,
                             measured.gc)

    def reset(self) -> None:
        self._tree.zero_counts()
        self._stack.restart_clocks()
        self._credits.reset()
        self.gc_pauses.clear()

    def tree(self) -> dict:
        return self._tree.as_dict()

    def events(self) -> List[ModuleEvent]:
        """[(path, type, depth, phase, start, end)] in order of ending: every stretch during which a module
        had a call running in a phase ('fwd', 'bwd' or 'recompute'), in perf_counter seconds. The same
        string objects repeat for a module, so pickling the list sends each path once."""
        return self._tree.events(self._stack.stretches)

    def uncounted_ops(self) -> List[UncountedOp]:
        """[UncountedOp] seen while counting, sorted by (op, phase): matrix-class aten ops without a formula."""
        return self._credits.uncounted_ops()

    def invisible_attention(self) -> List[dict]:
        """[{module, type, calls}]: the deepest modules whose type names attention (Attention, Attn) that ran
        forward calls in which no matrix work was counted, in their subtree either (modules left out by
        ignore_list excepted). Attention that reaches torch (SDPA, bmm, flash-attn's custom ops) always is, so
        such a module ran a kernel torch cannot see, and its attention FLOPs are missing."""
        return self._tree.invisible_attention()

    def results(self) -> ModuleResults:
        """What it measured; raises ModuleHooksFailed where a hook failed (what it measured is not whole)."""
        self._check_whole()
        return ModuleResults(self.tree(), self.uncounted_ops(), self.invisible_attention(),
                             gc=self.gc_pauses.summary)

    def _check_whole(self) -> None:
        if self._hooks.failure is not None:
            raise ModuleHooksFailed(self._hooks.failure)

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
        counter._check_whole()
        differ = self._tree.adopt_flops(counter._tree)
        return differ + self._credits.adopt(counter._credits)

    @contextlib.contextmanager
    def backward_outside_autograd(self) -> Iterator[None]:
        """Backward work a pipeline schedule runs outside autograd (a zero-bubble schedule's WeightPass: the
        weight-gradient GEMMs deferred out of the backward pass). Its ops count as backward; they go to the
        module whose deferred work runs (deferred_backward), else to the root, whose backward latency covers
        the whole of it."""
        if not self._hooks.measuring or self._stack.outside_autograd:
            yield
            return
        with self._stack.backward_outside_autograd(self._tree.root):
            yield

    def deferred_backward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn, handed out of the backward of the module running it now (the top of the stack), to be run later
        as that module's backward work: upstream's WeightGradStore defers the weight-gradient GEMM of each
        parallel linear this way. Outside a module's backward, fn itself."""
        entries = self._stack.entries
        if not self._hooks.measuring or not entries or entries[-1].phase != BACKWARD:
            return fn
        return self._hooks.deferred_backward(entries[-1].node, fn)

    def scoped_call(self, module: torch.nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A callable: proxy(*args) runs fn(module, *args) as a call of `module` (forward and backward)."""
        node = self._tree.node_of(module)
        if node is None:
            raise ValueError(f"scoped_call: {type(module).__name__} is not in the profiled module tree")
        return self._hooks.scoped_call(node, module, fn)
