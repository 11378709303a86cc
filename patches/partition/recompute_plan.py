"""Where to cut a pipeline and what each stage recomputes, chosen together under a memory limit: the partition and,
per stage, the first K_s of its recomputable layers (partition/recompute.py runs it), from one measured run.

A stage's time is its layers' time kept whole plus what each recomputed layer's recompute adds (both from the run
either way: report_recompute._both_ways_s), plus its position's overhead. Its peak is memory_model's with
each recomputed layer keeping its checkpoint (its input) instead of its activations whole, times the micro-batches
in flight, and the largest recomputed layer's activations alive while its backward runs, on top of the
backward's own rise (memory_model.stage_peak). Recomputing one more
layer never makes a stage faster, so each stage's best choice is the fewest layers that bring its peak within the
limit, found on its own for every stage position and layer range; the partition is then the one
whose stage times, sorted from the largest, are the smallest (planner.cheapest_parts). With no limit, nothing
recomputes. Where no partition fits even with every recomputable layer recomputed, the plan is the one whose
largest peak is the smallest, with by how much it exceeds.

No torch or DeepSpeed import.
"""
from bisect import bisect_left
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from patches.partition.memory_model import PositionMemory, RangeLargest, StagePeak, stage_peak
from patches.partition.planner import cheapest_parts, least_peak_parts


@dataclass(frozen=True)
class RecomputableLayer:
    """One layer as the run measured it, both ways."""
    index: int
    seconds: float  # kept whole: its forward with autograd and its backward, per iteration
    recompute_s: float  # what recomputing it adds per iteration
    recomputable: bool  # DeepSpeed would checkpoint it (a transformer layer in a GPT)
    state_bytes: int
    whole_bytes: int  # its activations kept whole, per micro-batch
    checkpoint_bytes: int  # kept as a checkpoint of it alone, per micro-batch
    largest_param_bytes: int = 0


@dataclass(frozen=True)
class StageChoice:
    """One stage of a plan: the layers it holds, how many of its recomputable ones it recomputes, what it takes."""
    first: int
    stop: int
    recomputed: int  # K_s: its first K_s recomputable layers
    seconds: float  # per iteration, with its position's overhead
    peak_bytes: int


@dataclass(frozen=True)
class RecomputePlan:
    parts: List[int]
    stages: List[StageChoice]
    excess_bytes: Optional[int]  # None: every stage within the limit (or none given); else the largest's excess

    @property
    def recompute(self) -> List[int]:
        """K_s per stage: --pp-recompute-layers' counts."""
        return [stage.recomputed for stage in self.stages]


class StageOptions:
    """Every stage's choice for every position and layer range (see the module docstring), each found in a few
    steps: sums over ranges by prefix sums."""

    def __init__(self, layers: Sequence[RecomputableLayer], positions: Sequence[PositionMemory],
                 overheads: Sequence[float]):
        self.layers = sorted(layers, key=lambda layer: layer.index)
        self.positions, self.overheads = list(positions), list(overheads)
        self._seconds = _prefix(layer.seconds for layer in self.layers)
        self._state = _prefix(layer.state_bytes for layer in self.layers)
        self._whole = _prefix(layer.whole_bytes for layer in self.layers)
        self._largest_param = RangeLargest([layer.largest_param_bytes for layer in self.layers])
        # the recomputable layers, by their place in self.layers; over them, what recomputing saves and costs
        self._recomputable = [place for place, layer in enumerate(self.layers) if layer.recomputable]
        chosen = [self.layers[place] for place in self._recomputable]
        self._saved = _prefix(max(0, layer.whole_bytes - layer.checkpoint_bytes) for layer in chosen)
        self._recompute_s = _prefix(layer.recompute_s for layer in chosen)

    def _span(self, first: int, stop: int) -> Tuple[int, int]:
        """The recomputable layers among first .. stop - 1, as a range of self._recomputable."""
        return bisect_left(self._recomputable, first), bisect_left(self._recomputable, stop)

    def choice(self, stage: int, first: int, stop: int, recomputed: int) -> StageChoice:
        """The stage holding layers first .. stop - 1 and recomputing its first `recomputed` recomputable ones."""
        start, end = self._span(first, stop)
        recomputed = min(recomputed, end - start)
        largest = max((self.layers[place].whole_bytes
                       for place in self._recomputable[start:start + recomputed]), default=0)
        return self._choice(stage, first, stop, start, recomputed, largest)

    def _choice(self, stage: int, first: int, stop: int, start: int, recomputed: int, largest: int) -> StageChoice:
        peak = self._peak(stage, first, stop, start, recomputed, self._rise(stop, start, recomputed, largest))
        seconds = (self._seconds[stop] - self._seconds[first] + self.overheads[stage]
                   + self._recompute_s[start + recomputed] - self._recompute_s[start])
        return StageChoice(first, stop, recomputed, seconds, peak.predicted_peak_bytes)

    def _rise(self, stop: int, start: int, recomputed: int, largest: int) -> int:
        """What the recompute adds to the backward's rise: the largest recomputed layer's activations whole, less
        what the layers after the recomputed ones kept (the backward has passed them, and freed it, by then)."""
        if not recomputed:
            return 0
        after_last = self._recomputable[start + recomputed - 1] + 1
        return max(0, largest - (self._whole[stop] - self._whole[after_last]))

    def _peak(self, stage: int, first: int, stop: int, start: int, recomputed: int, rise: int) -> StagePeak:
        """memory_model.stage_peak of layers first .. stop - 1 at `stage`, the first `recomputed` of their
        recomputable ones (from `start`) keeping their checkpoints, with the recompute's rise."""
        activation = self._whole[stop] - self._whole[first] - (self._saved[start + recomputed] - self._saved[start])
        position = self.positions[stage]
        largest = self._largest_param.of(first, stop) if position.step_floor_param_bytes else 0  # the floor's
        return stage_peak(self._state[stop] - self._state[first], activation, position, rise, largest)

    def _bound(self, stage: int, first: int, stop: int, start: int, recomputed: int) -> int:
        """The peak without the recompute's own rise: at most the choice's, and falling as more layers recompute
        (each keeps less). The search's hot path: no StageChoice, no seconds."""
        return self._peak(stage, first, stop, start, recomputed, 0).predicted_peak_bytes

    def recomputable(self, first: int, stop: int) -> int:
        start, end = self._span(first, stop)
        return end - start

    def fewest_within(self, stage: int, first: int, stop: int, limit: Optional[int]) -> Optional[StageChoice]:
        """The choice recomputing the fewest layers whose peak is within `limit` (None: nothing recomputes), or None
        where no choice is. The peak less the recompute's own rise falls as more layers recompute, so the fewest
        that bring it within the limit are found by halves; from there on, each count in order (the rise grows as
        fewer layers after the recomputed ones are freed: the peak need not fall), most often the first."""
        start, end = self._span(first, stop)
        nothing = self._choice(stage, first, stop, start, 0, 0)
        if limit is None or nothing.peak_bytes <= limit:
            return nothing
        low, high = 1, end - start
        if high < 1 or self._bound(stage, first, stop, start, high) > limit:
            return None
        while low < high:
            middle = (low + high) // 2
            if self._bound(stage, first, stop, start, middle) <= limit:
                high = middle
            else:
                low = middle + 1
        largest = max(self.layers[place].whole_bytes for place in self._recomputable[start:start + low - 1]) \
            if low > 1 else 0
        for recomputed in range(low, end - start + 1):
            largest = max(largest, self.layers[self._recomputable[start + recomputed - 1]].whole_bytes)
            choice = self._choice(stage, first, stop, start, recomputed, largest)
            if choice.peak_bytes <= limit:
                return choice
        return None


def plan_recompute(layers: Sequence[RecomputableLayer], positions: Sequence[PositionMemory],
                   overheads: Sequence[float], limit: Optional[int]) -> RecomputePlan:
    """The fastest partition into len(positions) stages, and each stage's recompute, whose every stage's peak is
    within `limit` (see the module docstring)."""
    options = StageOptions(layers, positions, overheads)
    chosen = {}

    def load_of(stage: int, first: int, stop: int) -> Optional[float]:
        choice = options.fewest_within(stage, first, stop, limit)
        chosen[stage, first, stop] = choice
        return choice.seconds if choice is not None else None

    stages, count = len(positions), len(options.layers)
    parts = cheapest_parts(load_of, count, stages)
    if parts is not None:
        return RecomputePlan(parts, [chosen[s, parts[s], parts[s + 1]] for s in range(stages)], None)

    def peak_all(stage: int, first: int, stop: int) -> int:
        return options.choice(stage, first, stop, options.recomputable(first, stop)).peak_bytes

    _, least = least_peak_parts(peak_all, count, stages)
    plan = plan_recompute(layers, positions, overheads, least)
    return RecomputePlan(plan.parts, plan.stages, least - limit)


def _prefix(values) -> List[float]:
    sums = [0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums
