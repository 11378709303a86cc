"""The allocator's level around each schedule instruction of one measured iteration, read from torch's own allocator.

    recorder = allocator_recorder(device_type)      # CpuAllocatorRecorder or DeviceAllocatorRecorder
    recorder.start()                                 # between iterations
    with recorder.instruction("ForwardPass", 0): ...  # every instruction of the iteration
    trace = recorder.stop()                          # AllocatorTrace, or None where it could not be read

CUDA (and any accelerator with allocator statistics): the bytes allocated, read from the allocator's own counters
(`memory_allocated`, `max_memory_allocated` after `reset_peak_memory_stats` at each instruction's start).

CPU: torch's CPU allocator keeps no statistics; torch.profiler records each of its allocations and frees while
`profile_memory` is on. The level at the start is every storage Python can reach (held_state.alive_storages),
and each allocation and free after it moves it. torch.profiler cannot report the free of a block allocated
before it started (it never saw its size: "Memory block of unknown size was allocated before the profiling
started"), such as the last stage's outputs DeepSpeed keeps from the previous iteration: each storage alive at
the start therefore carries a finalizer that marks its free in the profiler's own event stream (a
record_function event named with its bytes), on the same clock as the allocator's events. Instructions are
marked the same way. torch.profiler records no free made on another thread (a block freed by a second thread shows
its allocation only), so it loses now and then the free of a block the main thread allocated and a library's thread
let go last (under tensor parallelism every iteration: on the suite's pp 2 x tp 2 GPT, the 4 KB buffers of its
all-reduces, 6 or 7 a rank, which read its peaks 5.8% to 15.0% high in three runs; without, 3 of 54 launches of the
benchmark's GPT at pp 4: the 8.45 MB buffer DeepSpeed's ReduceGrads flattens stage 0's gradients into for its
all-reduce, never freed in the events, its address handed out again in OptimizerStep): an allocation at the address
of a block still live in the events is the allocator's proof that the block was freed, and its free is counted
there. Where a profiler is already running in this process (the user's), a second one cannot start: the CPU
allocator is then not read, and the trace says so.

With $PATCHES_TORCH_MEMORY_TRACE naming a directory, each rank also writes torch.profiler's own Chrome trace of
the measured iteration there (torch_memory_rank{R}.json, its "[memory]" events and these marks), to check the
figures against torch's events or to look at them.
"""
import bisect
import contextlib
import os
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple, Union

import torch
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

from patches.profiler.held_state import Storages, alive_storages

# A directory where each rank writes torch.profiler's Chrome trace of the measured iteration (the module docstring).
TRACE_DIRECTORY_VARIABLE = "PATCHES_TORCH_MEMORY_TRACE"
# Names of the events this module puts in torch.profiler's stream.
INSTRUCTION_MARK = "[patches memory] instruction "
UNSEEN_FREE_MARK = "[patches memory] free of a block allocated before profiling: "


@dataclass(frozen=True)
class InstructionMemory:
    """The allocator's level around one schedule instruction, in bytes allocated in the process (device)."""
    name: str
    buffer_id: Optional[int]
    start: int
    high: int  # the highest level while it ran (at least its start and its end)
    end: int


@dataclass(frozen=True)
class AllocatorTrace:
    """The allocator over one iteration: where it started, its instructions, its peak."""
    basis: str  # what was read, in words
    start_bytes: int  # allocated when the iteration started
    end_bytes: int  # allocated when it ended
    peak_bytes: int  # the highest level of the iteration
    peak_instruction: Optional[str]  # the instruction running at the peak (None: between instructions)
    instructions: Tuple[InstructionMemory, ...]
    unseen_free_bytes: int = 0  # CPU: frees of blocks older than the profiler, added from their storages' finalizers


class DeviceAllocatorRecorder:
    """An accelerator's allocator statistics (DeepSpeed's accelerator interface: torch.cuda on CUDA)."""

    def __init__(self, accelerator: DeepSpeedAccelerator):
        self.accelerator = accelerator
        self.basis = f"{accelerator.device_name()} allocator statistics (memory_allocated, max_memory_allocated)"
        self.not_read: Optional[str] = None  # the statistics are always there
        self._start = 0
        self._instructions: List[InstructionMemory] = []

    def start(self, held: Callable[[], Storages] = dict) -> None:
        """held: unused (the allocator counts every block itself)."""
        self._start = int(self.accelerator.memory_allocated())
        self._instructions = []

    @contextlib.contextmanager
    def instruction(self, name: str, buffer_id: Optional[int]) -> Iterator[None]:
        start = int(self.accelerator.memory_allocated())
        self.accelerator.reset_peak_memory_stats()
        try:
            yield
        finally:
            end = int(self.accelerator.memory_allocated())
            high = max(int(self.accelerator.max_memory_allocated()), start, end)
            self._instructions.append(InstructionMemory(name, buffer_id, start, high, end))

    def stop(self) -> AllocatorTrace:
        instructions = tuple(self._instructions)
        peak = max([self._start] + [i.high for i in instructions])
        where = next((i.name for i in instructions if i.high == peak), None)
        end = int(self.accelerator.memory_allocated())
        return AllocatorTrace(self.basis, self._start, end, peak, where, instructions)


class CpuAllocatorRecorder:
    """torch's CPU allocator, through torch.profiler's memory events (see the module docstring)."""

    basis = ("torch.profiler memory events of torch's CPU allocator, from every storage alive at the start "
             "(frees of those: from their finalizers)")

    def __init__(self):
        self.profile: Optional[torch.profiler.profile] = None  # the torch profiler while it runs, then its results
        self.not_read: Optional[str] = None  # why the allocator was not read
        self._start = 0
        self._preexisting: Storages = {}
        self._finalizers: List[weakref.finalize] = []
        self._instructions: List[Tuple[str, Optional[int]]] = []

    def start(self, held: Callable[[], Storages] = dict) -> None:
        """held(): storages only C++ may hold at the start besides those Python reaches (gradients), read first."""
        if torch._C._autograd._profiler_enabled():
            self.not_read = "torch.profiler was already running in this process (one profiler at a time)"
            return
        extra = held()  # reading them from Python (param.grad) makes them reachable by the walk below
        self._preexisting = alive_storages("cpu", self._watch)
        for key, size in extra.items():
            if key[0] == "cpu":
                self._preexisting.setdefault(key, size)
        self._start = sum(self._preexisting.values())
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.profile.start()

    def _watch(self, storage: torch.UntypedStorage, size: int) -> None:
        # A storage's Python object lives as long as the storage (torch preserves it), so its finalizer runs at the
        # free; it keeps no reference to the storage.
        self._finalizers.append(weakref.finalize(storage, _mark_unseen_free, size))

    @contextlib.contextmanager
    def instruction(self, name: str, buffer_id: Optional[int]) -> Iterator[None]:
        if self.profile is None:
            yield
            return
        self._instructions.append((name, buffer_id))
        with torch.profiler.record_function(f"{INSTRUCTION_MARK}{len(self._instructions) - 1}"):
            yield

    def stop(self) -> Optional[AllocatorTrace]:
        """The trace, or None where the allocator was not read (not_read says why)."""
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers = []
        if self.profile is None:
            return None
        self.profile.stop()
        directory = os.environ.get(TRACE_DIRECTORY_VARIABLE)
        if directory:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.profile.export_chrome_trace(os.path.join(directory, f"torch_memory_rank{rank}.json"))
        events, spans = _read_events(self.profile)
        return trace_from_events(self.basis, self._start, set(self._preexisting), events, spans, self._instructions)


def _mark_unseen_free(size: int) -> None:
    with torch.profiler.record_function(f"{UNSEEN_FREE_MARK}{size}"):
        pass


# One allocator event: (time ns, address or None for an unseen free, bytes: + allocated, - freed).
AllocatorEvent = Tuple[int, Optional[int], int]
# One instruction's span: (its index in the recorder's list, start ns, end ns).
InstructionSpan = Tuple[int, int, int]


def _read_events(profile: torch.profiler.profile) -> Tuple[List[AllocatorEvent], List[InstructionSpan]]:
    """The CPU allocator's events and the instruction spans of a stopped torch profiler, in memory (no file)."""
    allocation = torch._C._profiler._ExtraFields_Allocation
    events: List[AllocatorEvent] = []
    spans: List[InstructionSpan] = []
    stack = list(profile.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if isinstance(fields, allocation):
            if fields.device.type == "cpu":
                events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
        elif event.name.startswith(UNSEEN_FREE_MARK):
            events.append((event.start_time_ns, None, -int(event.name[len(UNSEEN_FREE_MARK):])))
        elif event.name.startswith(INSTRUCTION_MARK):
            spans.append((int(event.name[len(INSTRUCTION_MARK):]), event.start_time_ns, event.end_time_ns))
    return events, spans


def trace_from_events(basis: str, start_bytes: int, preexisting: set, events: List[AllocatorEvent],
                      spans: List[InstructionSpan], instructions: List[Tuple[str, Optional[int]]]) -> AllocatorTrace:
    """The levels of an iteration from its allocator events (pure: tested on made-up events).

    start_bytes: the level at the start; preexisting: the (device, address) keys alive then. A free the profiler
    reports at the address of a block alive at the start, with no allocation there since, is a size torch.profiler
    remembered from an earlier session (its table keeps blocks freed while it was off): left out, the block's own
    finalizer reports its free. An allocation at the address of a block allocated since the start and not freed in
    the events frees that block first: the allocator gave the address out again, so its free was lost (the module
    docstring)."""
    allocated_since = set()
    live = {}  # address -> bytes: the blocks allocated since the start and not freed in the events
    steps: List[Tuple[int, int]] = []  # (time, change)
    # at one instant, frees first: a block freed and its address given out again in the same tick is no lost free
    for time_ns, address, change in sorted(events, key=lambda e: (e[0], e[2])):
        if address is not None:
            if change > 0:
                if address in live:
                    steps.append((time_ns, -live[address]))
                live[address] = change
                allocated_since.add(address)
            elif ("cpu", address) in preexisting and address not in allocated_since:
                continue
            else:
                live.pop(address, None)
        steps.append((time_ns, change))
    times = [time_ns for time_ns, _ in steps]
    levels = []
    level = start_bytes
    for _, change in steps:
        level += change
        levels.append(level)

    def level_before(time_ns):  # the level once every event before time_ns happened
        index = bisect.bisect_left(times, time_ns)
        return levels[index - 1] if index else start_bytes

    measured: List[InstructionMemory] = []
    for index, start_ns, end_ns in sorted(spans, key=lambda s: s[1]):
        start, end = level_before(start_ns), level_before(end_ns + 1)
        inside = levels[bisect.bisect_left(times, start_ns):bisect.bisect_left(times, end_ns + 1)]
        name, buffer_id = instructions[index]
        measured.append(InstructionMemory(name, buffer_id, start, max([start, end] + inside), end))
    peak = max([start_bytes] + levels)
    where = None
    if levels and peak > start_bytes:
        peak_ns = times[levels.index(peak)]
        where = next((instructions[i][0] for i, start_ns, end_ns in spans if start_ns <= peak_ns <= end_ns), None)
    unseen = -sum(change for _, address, change in events if address is None)
    end = levels[-1] if levels else start_bytes
    return AllocatorTrace(basis, start_bytes, end, peak, where, tuple(measured), unseen)



def allocator_recorder(accelerator: DeepSpeedAccelerator) -> Union[CpuAllocatorRecorder, DeviceAllocatorRecorder]:
    """The recorder for the accelerator DeepSpeed runs on: its allocator statistics, or torch's CPU allocator."""
    if accelerator.device_name() == "cpu":
        return CpuAllocatorRecorder()
    return DeviceAllocatorRecorder(accelerator)
