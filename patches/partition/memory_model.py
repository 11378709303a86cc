"""A stage's memory peak under any partition, from what one run measured (the report's `layers` and
`stages[s].memory`; patches/profiler/memory.py measures them). No torch or DeepSpeed import.

What moves with a layer (the layer table):
  state_bytes          its parameters, their gradients and the optimizer's state, as held
  activation_bytes     what its forward keeps for backward, per micro-batch
  largest_param_bytes  its largest parameter (0 in a report without it)
What stays with a stage position (stages[s].memory):
  base_bytes               alive at the iteration's start besides the state (the last stage's kept outputs, data)
  outside_layers_bytes     what a micro-batch in flight holds besides its layers' activations (its input and output
                           buffers, the loss)
  in_flight_micro_batches  the schedule's, as it ran (DeepSpeed's 1F1B: min(pp - s, micro-batches))
  compute_transient_bytes  the largest rise of a forward or backward above its ends (the head's logits; where the
                           run recomputed a layer there, its activations, recreated inside a backward, with it)
  recomputed_transient_bytes  of that, what the run's own recompute there added (0: none recomputed there)
  holds_the_loss           the last position: its transient is the head's and the loss's, over before any layer's
                           backward (and recompute) begins
  step_transient_bytes     the optimizer step's, with the state it was measured with: it scales with the state
                           (the optimizer's temporaries follow what it updates), but for
  fixed_buffer_bytes       the part of it in buffers of a fixed size (ZeRO's reduction buckets, reduce_bucket_size
                           elements each): the same whatever layers the stage holds (0 in a report without it). The
                           rest may be negative (ZeRO lets gradients go once copied into a bucket): it scales too,
                           but never below the step floor times the stage's largest parameter:
  step floor               the optimizer's own transient (OptimizerStep's, less the fixed buffers) per byte of the
                           stage's largest parameter, the least over the run's stages: an optimizer that updates
                           one tensor at a time (torch's AdamW on CPU) holds temporaries of the largest (twice its
                           bytes) whatever else the stage holds, so a stage left with the embedding alone keeps its
                           step transient although its state shrinks (with_step_floor; none where a report lacks
                           the terms or a stage's is not positive)

    peak = base + state + max(in_flight x (activations + outside) + compute transient,
                              fixed + max((step transient - fixed) x state / state measured,
                                          step floor x the stage's largest parameter))

For as many stages as ran, each position keeps its measured terms. For another number of stages, the first and
the last keep theirs, the stages between take the run's second stage's (or the first's, from a 2-stage run), and
the micro-batches in flight are DeepSpeed's 1F1B's, min(pp - s, micro-batches): another schedule's in another
layout is not known, and is refused.
"""
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import List, Optional, Sequence, Tuple

ONE_F_ONE_B = "TrainSchedule"  # DeepSpeed's schedule class, as the report names it


@dataclass(frozen=True)
class LayerMemory:
    """What one layer takes wherever it goes."""
    index: int
    state_bytes: int
    activation_bytes: int  # per micro-batch
    largest_param_bytes: int = 0


@dataclass(frozen=True)
class PositionMemory:
    """What a stage position takes whatever layers it holds."""
    base_bytes: int
    outside_layers_bytes: int  # per micro-batch in flight
    in_flight_micro_batches: int
    compute_transient_bytes: int
    step_transient_bytes: int
    step_state_bytes: int  # the stage's state when its step transient was measured
    fixed_buffer_bytes: int = 0  # of the step transient: not scaled with the state
    recomputed_transient_bytes: int = 0  # of the compute transient: what the run's recompute here added
    holds_the_loss: bool = False  # the last position (see the module docstring)
    # the step floor (module docstring), as the ratio of the stage that set it: its optimizer's own transient less
    # the fixed buffers, and its largest parameter; 0 and 0: none
    step_floor_bytes: int = 0
    step_floor_param_bytes: int = 0


@dataclass(frozen=True)
class StagePeak:
    """One stage's predicted peak and its parts."""
    state_bytes: int
    activation_bytes: int  # per micro-batch in flight: its layers' and its position's outside them
    compute_peak_bytes: int  # base + state + in flight x activations + compute transient
    step_peak_bytes: int  # base + state + the step transient, scaled to the state
    predicted_peak_bytes: int  # the larger of the two


def stage_peak(state_bytes: int, layer_activation_bytes: int, position: PositionMemory,
               recompute_transient_bytes: int = 0, largest_param_bytes: int = 0) -> StagePeak:
    """The peak of a stage at `position` holding layers of these totals. recompute_transient_bytes: what a recompute
    adds to the backward's rise (recompute_plan.StageOptions._rise: the largest recomputed layer's activations whole,
    less what the layers after the recomputed ones kept, freed by then). It comes on top of the backward's own rise:
    the measured transient, less what the run's own recompute there added to it (recomputed_transient_bytes). On
    the stage that holds the loss the measured transient is the head's (its logits), over before the layers'
    backward begins: there the larger of the two counts. largest_param_bytes: the stage's largest parameter (the step
    floor's). Measured against 19 launches of the recompute proof
    (docs/benchmarks.md, part 13), from a run with recompute and one without: every stage's peak within -1.8% and
    +8.8%."""
    activation = layer_activation_bytes + position.outside_layers_bytes
    held = position.base_bytes + state_bytes
    if position.holds_the_loss:
        transient = max(position.compute_transient_bytes, recompute_transient_bytes)
    else:
        transient = max(0, position.compute_transient_bytes - position.recomputed_transient_bytes) \
            + recompute_transient_bytes
    compute = held + position.in_flight_micro_batches * activation + transient
    scaled = position.step_transient_bytes - position.fixed_buffer_bytes
    if position.step_state_bytes:
        scaled = scaled * state_bytes // position.step_state_bytes
    if position.step_floor_param_bytes:
        scaled = max(scaled, position.step_floor_bytes * largest_param_bytes // position.step_floor_param_bytes)
    step = held + position.fixed_buffer_bytes + scaled
    return StagePeak(state_bytes, activation, compute, step, max(compute, step))


def predict_peaks(layers: Sequence[LayerMemory], positions: Sequence[PositionMemory], parts: Sequence[int],
                  micro_batches: int, schedule: Optional[str] = ONE_F_ONE_B) -> List[StagePeak]:
    """Each stage's peak with the layers cut at `parts` (stage s holds layers parts[s] .. parts[s + 1] - 1);
    positions: as measured, one per stage that ran (see the module docstring for another number of stages)."""
    ordered = sorted(layers, key=lambda layer: layer.index)
    parts = list(parts)
    if len(parts) < 2 or parts[0] != 0 or parts[-1] != len(ordered) or any(a >= b for a, b in zip(parts, parts[1:])):
        raise ValueError(f"parts {parts} do not cut {len(ordered)} layers into non-empty stages")
    stages = len(parts) - 1
    peaks = []
    for stage, position in enumerate(positions_for(positions, stages, micro_batches, schedule)):
        held = ordered[parts[stage]:parts[stage + 1]]
        peaks.append(stage_peak(sum(layer.state_bytes for layer in held),
                                sum(layer.activation_bytes for layer in held), position,
                                largest_param_bytes=max(layer.largest_param_bytes for layer in held)))
    return peaks


def positions_for(positions: Sequence[PositionMemory], stages: int, micro_batches: int,
                  schedule: Optional[str] = ONE_F_ONE_B) -> List[PositionMemory]:
    """The positions of `stages` stages (see the module docstring)."""
    positions = list(positions)
    if stages == len(positions):
        return positions
    if schedule != ONE_F_ONE_B:
        raise ValueError(f"the run's schedule ({schedule}) keeps micro-batches in flight in a way not known for "
                         f"{stages} stages: predict for {len(positions)}, as it ran")
    if stages == 1:
        chosen = [positions[-1]]
    else:
        middle = positions[1] if len(positions) > 2 else positions[0]
        chosen = [positions[0]] + [middle] * (stages - 2) + [positions[-1]]
    return [replace(p, in_flight_micro_batches=min(stages - s, micro_batches)) for s, p in enumerate(chosen)]


# ---------------------------------------------------------------- a report's terms
def position_of(memory: dict) -> Optional[PositionMemory]:
    """A stage's position terms from its report `memory`; None where the allocator was not read."""
    if memory is None or memory.get("predicted_peak_bytes") is None:
        return None
    return PositionMemory(memory["base_bytes"], memory["outside_layers_bytes"], memory["in_flight_micro_batches"],
                          memory["compute_transient_bytes"], memory["step_transient_bytes"], memory["state_bytes"],
                          memory.get("fixed_buffer_bytes") or 0)


def memory_terms_of(report: dict) -> Optional[Tuple[List[LayerMemory], List[PositionMemory]]]:
    """(layers, positions) of a report whose every stage and layer has its memory measured; else None."""
    positions = [position_of(stage.get("memory")) for stage in report.get("stages") or ()]
    layers = report.get("layers")
    if not positions or None in positions or not layers:
        return None
    if any(row.get("state_bytes") is None or row.get("activation_bytes") is None for row in layers):
        return None
    largest = [0] * len(positions)
    for row in layers:
        if 0 <= row["stage"] < len(positions):
            largest[row["stage"]] = max(largest[row["stage"]], row.get("largest_param_bytes") or 0)
    optimizer = [stage["memory"].get("optimizer_step_transient_bytes") for stage in report["stages"]]
    return ([LayerMemory(row["index"], row["state_bytes"], row["activation_bytes"], row.get("largest_param_bytes") or 0)
             for row in layers], with_step_floor(positions, optimizer, largest))


def with_step_floor(positions: Sequence[PositionMemory], optimizer_transient_bytes: Sequence[Optional[int]],
                    largest_param_bytes: Sequence[int]) -> List[PositionMemory]:
    """The positions with the step floor (module docstring) of a run whose stages' optimizer steps held these
    transients, their stages these largest parameters: the least of (optimizer transient - fixed) / largest over
    them; unchanged where one is not known or not positive (ZeRO's step lets gradients go: the state alone scales
    it)."""
    rests = [(transient - position.fixed_buffer_bytes if transient is not None else 0, largest)
             for position, transient, largest in zip(positions, optimizer_transient_bytes, largest_param_bytes)]
    if not rests or any(rest <= 0 or largest <= 0 for rest, largest in rests):
        return list(positions)
    rest, largest = min(rests, key=lambda pair: Fraction(*pair))
    return [replace(position, step_floor_bytes=rest, step_floor_param_bytes=largest) for position in positions]


class RangeLargest:
    """The largest of values[first:stop] in one step (a sparse table), for the planner's many ranges."""

    def __init__(self, values: Sequence[int]):
        self._levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            below = self._levels[-1]
            self._levels.append([max(below[i], below[i + width]) for i in range(len(below) - width)])
            width *= 2

    def of(self, first: int, stop: int) -> int:
        if stop <= first:
            return 0
        level = (stop - first).bit_length() - 1
        row = self._levels[level]
        return max(row[first], row[stop - (1 << level)])
