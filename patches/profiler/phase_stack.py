"""The stack of module entries running now, and the per-phase clocks that turn it into latencies.

- Entries: the hooks (module_hooks.py) push an entry when a module's forward, recompute or backward call
  starts and pop it when the call ends; the innermost entry is who FLOPs are credited to (flop_counting.py).
- Nesting: every entry pushed in a phase has all its tree ancestors on the stack in that phase. Those
  not running a call of their own (the pipeline module while its layers recompute inside backward,
  or while a child's backward starts a hook earlier than the parent's at the same autograd node) get
  an implicit entry that opens and closes with the entry that needed it. A module's latency is the
  time during which it has at least one entry in that phase, so children never exceed their parent.
- Backward runs subtree by subtree: a backward entry pushed closes the backward entries above its last
  ancestor on the stack, and the end of a graph task closes every entry pushed in it (close_task).
- Latency: `synchronize()` then `time.perf_counter()` at every push and pop, less the garbage collector's
  pauses so far (gc_pauses.py: a pause is no module's work). Only the phase on top of the stack is timed,
  so the three phases never share a second: a recompute running inside a backward (reentrant checkpoint in
  the pipeline module's backward, or non-reentrant recompute inside a layer's backward node) counts as
  recompute, not also as backward.
- The phase of an op (op_phase): phases.current_phase, except that an op under a recompute call is
  recompute work even with grad mode off (autograd runs a custom Function's forward, Megatron's parallel
  linears for one, without grad), and that backward work run outside autograd (backward_outside_autograd:
  a zero-bubble schedule's WeightPass) is backward work.
- Stretches: each stretch during which a module is active in a phase is also kept as a wall-clock
  interval (one tuple appended when the stretch ends, from the clock reads above, pauses included). Stretches come from
  one stack, so they nest; a backward stretch encloses a recompute running inside it.
"""
import contextlib
import time
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from patches.profiler.gc_pauses import GcPauses
from patches.profiler.module_tree import ModuleNode
from patches.profiler.phases import BACKWARD, FORWARD, PHASES, RECOMPUTE, current_phase

# (node, phase, wall-clock start, end): one stretch of a module's activity in a phase
Stretch = Tuple[ModuleNode, int, float, float]

_graph_task_id = torch._C._current_graph_task_id
_perf_counter = time.perf_counter


def _no_sync():
    pass


class Entry:
    """A node's presence on the stack in one phase. `owner` is set on an implicit entry: the entry
    that needed this ancestor and whose pop removes it."""
    __slots__ = ("node", "phase", "owner", "task", "live")

    def __init__(self, node: ModuleNode, phase: int, owner: Optional["Entry"], task: int):
        self.node, self.phase, self.owner, self.task = node, phase, owner, task
        self.live = True


class PhaseStack:
    """The entries of the module calls running now, bottom first, and the latency of every node, per phase.

    `entries` is read by the FLOP crediting on every op; it is never rebound, so a reader may keep it, and
    only this class changes it. `stretches` grows by one (node, phase, start, end) per stretch of activity."""

    def __init__(self, nodes: Sequence[ModuleNode], synchronize: Optional[Callable[[], None]] = None,
                 pauses: Optional[GcPauses] = None):
        self._nodes = tuple(nodes)
        self._synchronize = synchronize or _no_sync
        self._pauses = pauses or GcPauses()  # one not watching pauses nothing
        self.entries: List[Entry] = []
        self.stretches: List[Stretch] = []
        self.outside_autograd = False  # in backward work a schedule runs outside autograd
        self.clear()

    def now(self) -> Tuple[float, float]:
        """The clocks of every push and pop, once the device's queued work is done: (perf_counter, the same less
        the collector's pauses so far). No collection can run between the two reads (nothing is allocated)."""
        self._synchronize()
        now = _perf_counter()
        return now, now - self._pauses.paused_s

    def push(self, node: ModuleNode, phase: int) -> Entry:
        """Open an entry of `node` in `phase` (and the implicit entries of its ancestors not running)."""
        now, clock = self.now()
        entries = self.entries
        low = len(entries)
        while low and entries[low - 1].phase == phase:
            low -= 1
        if phase == BACKWARD:
            for index in range(low, len(entries)):
                entry = entries[index]
                if entry.node is node and entry.owner is not None:
                    # A descendant's backward started first at the same autograd node; this node's own
                    # start adopts the implicit entry (and the implicit ancestors below it).
                    for below in entries[low:index]:
                        if below.owner is entry.owner:
                            below.owner = entry
                    entry.owner = None
                    return entry
            # Backward runs subtree by subtree: whatever is not an ancestor of this node has finished.
            for index in range(low, len(entries)):
                if entries[index].node not in node.ancestor_set:
                    self._close_from(index, now, clock)
                    break
        task = _graph_task_id()
        entry = Entry(node, phase, None, task)
        running = {other.node for other in entries[low:]}
        for ancestor in node.ancestors:
            if ancestor not in running:
                self._open(Entry(ancestor, phase, entry, task), now, clock)
        self._open(entry, now, clock)
        return entry

    def pop(self, entry: Entry) -> None:
        """Close a live entry, whatever is above it, and the implicit ancestors pushed for it."""
        if not entry.live:
            return
        now, clock = self.now()
        entries = self.entries
        index = len(entries) - 1
        while entries[index] is not entry:
            index -= 1
        while index and entries[index - 1].owner is entry:
            index -= 1
        self._close_from(index, now, clock)

    def close_task(self, task: int) -> None:
        """The end of graph task `task`: close its first entry and everything above it."""
        for index, entry in enumerate(self.entries):
            if entry.task == task:
                self._close_from(index, *self.now())
                break

    def clear(self) -> None:
        """Drop every entry unmeasured (profiling starts or stops), and stop the phase clocks."""
        for entry in self.entries:
            entry.live = False
        self.entries.clear()
        self._top_phase, self._top_since = None, 0.0
        self._phase_elapsed = [0.0, 0.0, 0.0]
        for node in self._nodes:
            node.active[:] = [0, 0, 0]

    def restart_clocks(self) -> None:
        """Measure from now on (reset): the nodes active now count from now, and no stretch is kept."""
        now, clock = self.now()
        for node in self._nodes:
            node.since[:] = [self._phase_clock(phase, clock) for phase in PHASES]
            node.wall_since[:] = [now, now, now]
        self.stretches.clear()

    def op_phase(self) -> int:
        """The phase of an aten op dispatched now (see the module docstring)."""
        phase = current_phase()
        entries = self.entries
        if phase == BACKWARD and entries and entries[-1].phase == RECOMPUTE:
            return RECOMPUTE
        if phase == FORWARD and self.outside_autograd:
            return BACKWARD
        return phase

    @contextlib.contextmanager
    def backward_outside_autograd(self, node: ModuleNode) -> Iterator[None]:
        """A backward entry of `node` around work run outside autograd; ops inside count as backward."""
        outside = self.outside_autograd
        self.outside_autograd = True
        entry = self.push(node, BACKWARD)
        try:
            yield
        finally:
            self.pop(entry)
            self.outside_autograd = outside

    def _phase_clock(self, phase, clock):
        """Seconds during which `phase` was the phase of the top of the stack (pauses left out: `clock`)."""
        elapsed = self._phase_elapsed[phase]
        return elapsed + (clock - self._top_since) if phase == self._top_phase else elapsed

    def _retop(self, clock):
        """Only the top phase's clock runs: a backward waiting on a recompute above it is paused."""
        top = self.entries[-1].phase if self.entries else None
        if top != self._top_phase:
            if self._top_phase is not None:
                self._phase_elapsed[self._top_phase] += clock - self._top_since
            self._top_phase, self._top_since = top, clock

    def _open(self, entry, now, clock):
        self.entries.append(entry)
        self._retop(clock)
        node, phase = entry.node, entry.phase
        if node.active[phase] == 0:
            node.since[phase] = self._phase_clock(phase, clock)
            node.wall_since[phase] = now
        node.active[phase] += 1

    def _close_from(self, index, now, clock):
        """Close the entry at `index` and everything above it (`now` the wall clock, `clock` without pauses)."""
        entries = self.entries
        for entry in entries[index:]:
            entry.live = False
            node, phase = entry.node, entry.phase
            node.active[phase] -= 1
            if node.active[phase] == 0:
                node.latency_s[phase] += self._phase_clock(phase, clock) - node.since[phase]
                self.stretches.append((node, phase, node.wall_since[phase], now))
        del entries[index:]
        self._retop(clock)
