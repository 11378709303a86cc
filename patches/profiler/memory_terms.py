"""The terms of a stage's memory peak, derived from what memory.py measured (allocator_terms, a pure function),
and what a measurement yields (StageMemory).

The terms:
  base         the bytes alive at the start that are no state (the last stage's outputs DeepSpeed keeps from the
               iteration before, the data, ...). Not at the end: what an iteration still holds when it returns
               (its loss, Megatron's logging) is let go before the next one starts. A process's first iteration
               starts without what it then makes to keep (the optimizer's state, receive buffers): measure a
               later one for the steady state
  in flight    the most micro-batches forwarded and not yet backwarded (the schedule as it ran)
  kept         what one micro-batch in flight holds: the median of its forward's net allocation (its
               LoadMicroBatch or RecvActivation included); its layers' saved activations are part of it
  transients   the compute's: the largest rise of one instruction (ForwardPass, BackwardPass, ...) above both its
               ends (the head's logits, a recompute); the step's: the highest level of the optimizer step's
               instructions (ReduceTiedGrads, ReduceGrads, OptimizerStep) above base and state, everything the
               step holds besides them (the optimizer's temporaries, ZeRO's reduction buckets, whenever made);
               of it, the optimizer's own: the highest level of OptimizerStep alone above base and state (an
               optimizer that updates one tensor at a time holds temporaries of the largest parameter there)
  fixed buffers of the step transient: the most bytes ZeRO's reduction buckets held at once in the step
               (held_state.reduction_buckets; beyond those alive at the start, which are base), read around each
               instruction and just before ZeRO lets them go inside ReduceGrads (its _release_ipg_buffers): their
               size is the optimizer's reduce_bucket_size, not the stage's parameters. The rest of the step
               transient may be negative: ZeRO lets gradients go once it has copied them into a bucket
  predicted peak = base + state + max(in flight x kept + compute transient, step transient)
  measured peak  = the allocator's highest level in the iteration
The report composes these with the layer table (partition/memory_model.py makes the prediction, for these parts
or any other).
"""
import statistics
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Sequence

from patches.profiler.allocator_trace import AllocatorTrace, InstructionMemory

# The instructions of the optimizer step; every other instruction is compute (or a message).
STEP_INSTRUCTIONS = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
OPTIMIZER_STEP = "OptimizerStep"
# What a micro-batch's forward side allocates before its ForwardPass: its input.
_INPUT_INSTRUCTIONS = ("LoadMicroBatch", "RecvActivation")
# The instruction after which a micro-batch no longer holds its activations (zero-bubble: the input-gradient pass).
_RELEASING_INSTRUCTIONS = ("BackwardPass", "BackwardOnlyPass")


@dataclass(frozen=True)
class AllocatorTerms:
    """The peak's terms read off the allocator trace (allocator_terms)."""
    start_bytes: int
    end_bytes: int
    base_bytes: int
    kept_bytes_per_micro_batch: int
    in_flight_micro_batches: int
    compute_transient_bytes: int
    step_transient_bytes: int
    measured_peak_bytes: int
    measured_peak_instruction: Optional[str]
    unseen_free_bytes: int
    optimizer_step_transient_bytes: int = 0  # of step_transient_bytes: OptimizerStep's alone


@dataclass(frozen=True)
class StageMemory:
    """One rank's memory over the measured iteration, per GPU (see the module docstring)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    optimizer_created_bytes: int  # optimizer state created in the measured step (a first step creates Adam's)
    layer_activation_bytes: Dict[int, int]  # layer index -> what its forward keeps for backward, per micro-batch
    layer_state_bytes: Dict[int, int]  # layer index -> its share of the state, by its parameters
    layer_recompute_bytes: Dict[int, int]  # layer index -> what its recompute saves (during its backward only)
    outside_layers_activation_bytes: int  # saved for backward by no layer, per micro-batch
    micro_batches: int
    basis: Optional[str]  # how the allocator was read; None where it was not
    not_read: Optional[str] = None  # why the allocator was not read
    allocator: Optional[AllocatorTerms] = None
    fixed_buffer_bytes: int = 0  # ZeRO's reduction buckets, the most the step held at once (none of the state)
    layer_input_bytes: Dict[int, int] = field(default_factory=dict)  # layer index -> its forward's input, per call
    layer_largest_param_bytes: Dict[int, int] = field(default_factory=dict)  # layer index -> its largest parameter

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def as_dict(self) -> dict:
        """The entry's form: JSON keys are strings, so the layers are [index, bytes] pairs in index order."""
        data = asdict(self)
        for name in ("layer_activation_bytes", "layer_state_bytes", "layer_recompute_bytes", "layer_input_bytes",
                     "layer_largest_param_bytes"):
            data[name] = sorted([int(index), int(size)] for index, size in data[name].items())
        data["state_bytes"] = self.state_bytes
        return data


def allocator_terms(trace: AllocatorTrace, state_at_start: int, state_bytes: int) -> AllocatorTerms:
    """The terms of the module docstring from one iteration's allocator trace; state_at_start: the state's bytes
    alive when it started; state_bytes: all of it, as the step holds it."""
    instructions = trace.instructions
    base = trace.start_bytes - state_at_start
    step_high = max((i.high for i in instructions if i.name in STEP_INSTRUCTIONS), default=None)
    optimizer_high = max((i.high for i in instructions if i.name == OPTIMIZER_STEP), default=None)
    return AllocatorTerms(
        start_bytes=trace.start_bytes,
        end_bytes=trace.end_bytes,
        base_bytes=base,
        kept_bytes_per_micro_batch=_kept_per_micro_batch(instructions),
        in_flight_micro_batches=_in_flight(instructions),
        compute_transient_bytes=max((i.high - max(i.start, i.end) for i in instructions
                                     if i.name not in STEP_INSTRUCTIONS), default=0),
        step_transient_bytes=max(0, step_high - base - state_bytes) if step_high is not None else 0,
        measured_peak_bytes=trace.peak_bytes,
        measured_peak_instruction=trace.peak_instruction,
        unseen_free_bytes=trace.unseen_free_bytes,
        optimizer_step_transient_bytes=max(0, optimizer_high - base - state_bytes) if optimizer_high is not None
        else 0)


def _kept_per_micro_batch(instructions: Sequence[InstructionMemory]) -> int:
    """The median over micro-batches of a forward's net allocation, with that of its input's instruction."""
    input_net: Dict[Optional[int], int] = {}
    nets = []
    for instruction in instructions:
        net = instruction.end - instruction.start
        if instruction.name in _INPUT_INSTRUCTIONS:
            input_net[instruction.buffer_id] = input_net.get(instruction.buffer_id, 0) + net
        elif instruction.name == "ForwardPass":
            nets.append(net + input_net.pop(instruction.buffer_id, 0))
    return int(statistics.median_low(nets)) if nets else 0


def _in_flight(instructions: Sequence[InstructionMemory]) -> int:
    """The most micro-batches forwarded and not yet backwarded; the one being backwarded still counts."""
    running = most = 0
    for instruction in instructions:
        if instruction.name == "ForwardPass":
            running += 1
            most = max(most, running)
        elif instruction.name in _RELEASING_INSTRUCTIONS:
            running = max(0, running - 1)
    return most
