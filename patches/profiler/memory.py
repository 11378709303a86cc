"""What one rank's stage holds in memory over one iteration, measured as it ran: the figures the report's
`stages[s].memory` and the layer table's `activation_bytes` / `state_bytes` come from.

    memory = MemoryMeasurement.started(engine, accelerator, layers, faults)   # between iterations
    with memory.instruction_guarded(name, buffer_id): ...     # every schedule instruction (EngineHooks' timer)
    stage_memory = memory.stop()                              # StageMemory, or None where a part failed (the
                                                              # fault log, fail_safe.py, says what); no hook left

Three readings, each torch's own (their files say how):
- the state (held_state.py): parameters and gradients as held when the optimizer step starts (every gradient is
  there), the optimizer's state when it ends (a first step creates it);
- the activations each layer keeps for backward per micro-batch (kept_activations.py);
- the allocator around every instruction (allocator_trace.py).
Their terms, and the peak predicted from them: memory_terms.py.

It measures the iteration where the FLOPs are counted (the dispatch mode's: one_step.ProfileSchedule's N - 1),
so the profiled iteration runs without any of it; where that iteration is the profiled one, its timing carries
this too, as it carries the dispatch mode (the report's perturbation says how much).
"""
import contextlib
from typing import Callable, ContextManager, Dict, Iterator, List, Optional

import torch
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.runtime.engine import DeepSpeedEngine

from patches.profiler.allocator_trace import AllocatorTrace, allocator_recorder
from patches.profiler.fail_safe import MEMORY, FaultLog
from patches.profiler.held_state import HeldState, held_state, reduction_buckets
from patches.profiler.kept_activations import KeptActivations
from patches.profiler.memory_terms import STEP_INSTRUCTIONS, StageMemory, allocator_terms
from patches.profiler.shadowing import shadow

# ZeRO's method that lets its reduction buckets go (DeepSpeed 0.16 to 0.19), called inside ReduceGrads.
_BUCKETS_RELEASE = "_release_ipg_buffers"


class MemoryMeasurement:
    """The three readings of one rank's stage over one iteration (see the module docstring)."""

    def __init__(self, engine: DeepSpeedEngine, accelerator: DeepSpeedAccelerator,
                 layers: Optional[List[dict]] = None, faults: Optional[FaultLog] = None):
        """layers: the stage's layers (partition/layers.stage_layers), None off a PipelineModule. faults: where what
        fails while it runs inside the iteration is recorded (fail_safe.py; the caller's, to read after stop)."""
        self.faults = faults if faults is not None else FaultLog()
        self.engine = engine
        self.module = engine.module
        self.layers = layers
        self.optimizer = getattr(engine, "optimizer", None)
        self.device_type = "cpu" if accelerator.device_name() == "cpu" else accelerator.device_name()
        self.recorder = allocator_recorder(accelerator)
        self.kept = KeptActivations(self.module, self.faults)
        self._at_start: Optional[HeldState] = None
        self._before_step: Optional[HeldState] = None
        self._after_step: Optional[HeldState] = None
        self._optimizer_before_step = 0
        self._instruction: Optional[str] = None  # the one running
        self._step_buckets = 0  # the most reduction bucket bytes seen at once in the step
        self._unwatch: Callable[[], None] = lambda: None
        self._detached = False

    @classmethod
    def started(cls, engine: DeepSpeedEngine, accelerator: DeepSpeedAccelerator,
                layers: Optional[List[dict]] = None, faults: Optional[FaultLog] = None) -> "MemoryMeasurement":
        memory = cls(engine, accelerator, layers, faults)
        memory.start()
        return memory

    def start(self) -> None:
        """Attach and read the start; an error is recorded in the fault log (nothing is left attached then)."""
        with self.faults.guard(MEMORY, "start"):
            self._at_start = held_state(self.module, self.optimizer)
            self.kept.attach()
            self._unwatch = watch_release(self.optimizer, self._read_buckets)
            self.recorder.start(self._at_start.all)
        if self.faults.failed(MEMORY):
            self._detach()

    def _read_buckets(self) -> None:
        """The reduction buckets held now, where the step runs (inside ZeRO's step: an error is only recorded)."""
        if self._instruction in STEP_INSTRUCTIONS and not self.faults.failed(MEMORY):
            with self.faults.guard(MEMORY, self._instruction):
                held = _on_device(reduction_buckets(self.optimizer), self.device_type)
                self._step_buckets = max(self._step_buckets, held)

    @contextlib.contextmanager
    def instruction(self, name: str, buffer_id: Optional[int] = None) -> Iterator[None]:
        """One schedule instruction: the allocator around it, what a forward keeps for backward (read off its
        graph once it is over), and the state around the optimizer step."""
        if name == "OptimizerStep":
            self._before_step = held_state(self.module, self.optimizer)
        loss = getattr(self.engine, "loss", None)
        self._instruction = name
        self._read_buckets()
        try:
            with self.recorder.instruction(name, buffer_id):
                yield
            self._read_buckets()
        finally:
            self._instruction = None
        if name == "ForwardPass":  # what its graph keeps outside the layers: behind its outputs and its loss
            outputs = getattr(self.engine, "pipe_buffers", {}).get("outputs", [])
            roots = [outputs[buffer_id]] if buffer_id is not None and buffer_id < len(outputs) else []
            if getattr(self.engine, "loss", None) is not loss:  # the last stage's, made by this forward
                roots.append(self.engine.loss)
            self.kept.forwarded(roots)
        if name == "OptimizerStep":
            self._after_step = held_state(self.module, self.optimizer)

    def instruction_guarded(self, name: str, buffer_id: Optional[int] = None) -> ContextManager[None]:
        """instruction(), with what it fails at recorded in the fault log: the instruction itself runs once, as
        unmeasured, and raises what it raises; after a fault, the iteration's next instructions are not measured."""
        return self.faults.around(MEMORY, name, self.instruction(name, buffer_id))

    def _detach(self) -> Optional[AllocatorTrace]:
        """Every hook off and the allocator's recording stopped, each tried whatever the others do, once: the
        allocator's trace (None where it was not read)."""
        if self._detached:
            return None
        self._detached = True
        for undo in (self.kept.remove, self._unwatch):
            with self.faults.guard(MEMORY, "stop"):
                undo()
        with self.faults.guard(MEMORY, "stop"):
            return self.recorder.stop()
        return None

    def stop(self) -> Optional[StageMemory]:
        """Every hook off; what was measured, or None where a part of it failed (the fault log says what)."""
        trace = self._detach()
        if not self.faults.failed(MEMORY):
            with self.faults.guard(MEMORY, "stop"):
                return self._measured(trace)
        return None

    def _measured(self, trace: Optional[AllocatorTrace]) -> StageMemory:
        before = self._before_step or held_state(self.module, self.optimizer)  # no step ran: as held now
        after = self._after_step or before
        kept = self.kept.result()
        state = before.param_bytes + before.grad_bytes + after.optimizer_bytes
        terms = None
        if trace is not None:
            terms = allocator_terms(trace, _on_device(self._at_start.state(), self.device_type), state)
        alive_at_start = _on_device(self._at_start.fixed, self.device_type)  # those are base
        return StageMemory(
            param_bytes=before.param_bytes, grad_bytes=before.grad_bytes, optimizer_bytes=after.optimizer_bytes,
            optimizer_created_bytes=max(0, after.optimizer_bytes - before.optimizer_bytes),
            layer_activation_bytes=kept.layers, layer_state_bytes=self._layer_state_bytes(state),
            layer_recompute_bytes=kept.recompute, outside_layers_activation_bytes=kept.outside_layers,
            micro_batches=kept.micro_batches, basis=trace.basis if trace is not None else None,
            not_read=self.recorder.not_read, allocator=terms,
            fixed_buffer_bytes=max(0, self._step_buckets - alive_at_start), layer_input_bytes=kept.inputs,
            layer_largest_param_bytes=layer_largest_param_bytes(self.module, self.layers or []))

    def _layer_state_bytes(self, state: int) -> Dict[int, int]:
        """Each layer's share of the state, by its parameters on this rank."""
        return shares(state, layer_param_numels(self.module, self.layers or []))


def watch_release(optimizer: object, before: Callable[[], None]) -> Callable[[], None]:
    """before() each time `optimizer` (a ZeRO one) is about to let its reduction buckets go; returns what undoes
    it. Nothing for an optimizer without that method."""
    release = getattr(optimizer, _BUCKETS_RELEASE, None)
    if not callable(release):
        return lambda: None

    def watched(*args, **kwargs):
        before()
        return release(*args, **kwargs)

    return shadow(optimizer, _BUCKETS_RELEASE, watched)


def shares(total: int, weights: Dict[int, int]) -> Dict[int, int]:
    """`total` split in proportion to `weights`, in whole bytes that add up to it: each share rounded down, the bytes
    left over one each to the largest remainders (the lower index first); all zeros where no weight is."""
    weight = sum(weights.values())
    if not weight:
        return {index: 0 for index in weights}
    split = {index: total * w // weight for index, w in weights.items()}
    left = total - sum(split.values())
    by_remainder = sorted(weights, key=lambda index: (-(total * weights[index] % weight), index))
    for index in by_remainder[:left]:
        split[index] += 1
    return split


def layer_param_numels(module: torch.nn.Module, layers: List[dict]) -> Dict[int, int]:
    """Each layer's parameters' elements on this rank, from its node in the stage module (layers.stage_layers); a
    tied module used by several layers of the stage split evenly among them; a function layer has none."""
    uses: Dict[str, int] = {}
    for layer in layers:
        if layer["node"]:
            uses[layer["node"]] = uses.get(layer["node"], 0) + 1
    return {layer["index"]: sum(p.numel() for p in module.get_submodule(layer["node"]).parameters())
            // uses[layer["node"]] if layer["node"] else 0 for layer in layers}


def layer_largest_param_bytes(module: torch.nn.Module, layers: List[dict]) -> Dict[int, int]:
    """Each layer's largest parameter on this rank, in bytes (a tied module's in every layer that uses it; a function
    layer has none): an optimizer that updates one tensor at a time holds temporaries of the largest."""
    def largest(node: Optional[str]) -> int:
        if not node:
            return 0
        return max((p.numel() * p.element_size() for p in module.get_submodule(node).parameters()), default=0)

    return {layer["index"]: largest(layer["node"]) for layer in layers}


def _on_device(storages: dict, device_type: str) -> int:
    return sum(size for (device, _), size in storages.items() if device.split(":")[0] == device_type)
