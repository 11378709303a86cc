"""The partition and each stage's recompute, chosen together (patches/partition/recompute_plan.py), against every
partition and every count of recomputed layers per stage, on small random layer tables: the fastest whose every
stage's predicted peak is within the limit, as the memory model predicts each."""
import itertools
import random
from dataclasses import replace

import pytest

from patches.partition.memory_model import PositionMemory, stage_peak
from patches.partition.recompute_plan import RecomputableLayer, plan_recompute


def _peak_and_seconds(layers, positions, overheads, parts, counts):
    """(each stage's peak, each stage's seconds) of this choice, by the module's rule, written out plainly."""
    peaks, seconds = [], []
    for stage, (first, stop) in enumerate(zip(parts, parts[1:])):
        held = layers[first:stop]
        chosen = [layer for layer in held if layer.recomputable][:counts[stage]]
        activation = sum(layer.checkpoint_bytes if layer in chosen else layer.whole_bytes for layer in held)
        # the recompute's rise: the largest recomputed layer kept whole, less what the layers after the last
        # recomputed one kept (freed by the time its backward runs)
        after = held[held.index(chosen[-1]) + 1:] if chosen else []
        transient = max(0, max(layer.whole_bytes for layer in chosen) - sum(layer.whole_bytes for layer in after)) \
            if chosen else 0
        peaks.append(stage_peak(sum(layer.state_bytes for layer in held), activation, positions[stage],
                                transient, max(layer.largest_param_bytes for layer in held)).predicted_peak_bytes)
        seconds.append(sum(layer.seconds for layer in held) + sum(layer.recompute_s for layer in chosen)
                       + overheads[stage])
    return peaks, seconds


def brute_force(layers, positions, overheads, limit):
    """(sorted-descending seconds, parts, counts) of the best fitting choice; None where none fits."""
    n, stages, best = len(layers), len(positions), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        parts = [0, *cuts, n]
        ranges = [sum(layer.recomputable for layer in layers[a:b]) for a, b in zip(parts, parts[1:])]
        for counts in itertools.product(*(range(r + 1) for r in ranges)):
            peaks, seconds = _peak_and_seconds(layers, positions, overheads, parts, counts)
            if limit is not None and max(peaks) > limit:
                continue
            key = (tuple(sorted(seconds, reverse=True)), parts)
            if best is None or key < best[:2]:
                best = (*key, list(counts))
    return best


def random_case(rng, n, stages):
    layers = []
    for index in range(n):
        recomputable = rng.random() < 0.7
        whole = rng.randint(50, 400)
        layers.append(RecomputableLayer(index, rng.uniform(1, 10), rng.uniform(0.5, 4) if recomputable else 0.0,
                                        recomputable, rng.randint(10, 200), whole, rng.randint(5, whole)))
    positions = [PositionMemory(rng.randint(0, 100), rng.randint(0, 50), stages - s, rng.randint(0, 300),
                                rng.randint(0, 200), rng.randint(1, 500)) for s in range(stages)]
    overheads = [rng.uniform(0, 3) for _ in range(stages)]
    # each layer's largest parameter, and in half the cases an optimizer's floor on the step transient
    layers = [replace(layer, largest_param_bytes=rng.randint(0, 100)) for layer in layers]
    if rng.random() < 0.5:
        floor = dict(step_floor_bytes=rng.randint(1, 600), step_floor_param_bytes=rng.randint(1, 100))
        positions = [replace(position, **floor) for position in positions]
    return layers, positions, overheads


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_is_the_fastest_that_fits(seed):
    rng = random.Random(seed)
    n, stages = rng.randint(3, 7), rng.randint(1, 3)
    layers, positions, overheads = random_case(rng, n, stages)
    limit = rng.choice([None, rng.randint(300, 3000)])
    expected = brute_force(layers, positions, overheads, limit)
    plan = plan_recompute(layers, positions, overheads, limit)
    if expected is None:
        assert plan.excess_bytes is not None and plan.excess_bytes > 0
        return
    assert plan.excess_bytes is None
    assert (plan.parts, plan.recompute) == (expected[1], expected[2])
    peaks, seconds = _peak_and_seconds(layers, positions, overheads, plan.parts, plan.recompute)
    assert [stage.peak_bytes for stage in plan.stages] == peaks
    assert [stage.seconds for stage in plan.stages] == pytest.approx(seconds)


def test_without_a_limit_nothing_recomputes():
    layers, positions, overheads = random_case(random.Random(7), 6, 2)
    assert plan_recompute(layers, positions, overheads, None).recompute == [0, 0]


def test_stage_0_recomputes_most_where_it_holds_the_most_micro_batches():
    """8 equal layers on pp 2, 2 micro-batches in flight on stage 0 and 1 on stage 1: a limit that 4 layers on
    stage 0 exceed by a byte recomputes there, and not on stage 1."""
    layers = [RecomputableLayer(i, 1.0, 0.3, True, 100, 200, 20) for i in range(8)]
    positions = [PositionMemory(0, 0, 2, 0, 0, 1), PositionMemory(0, 0, 1, 0, 0, 1)]
    plan = plan_recompute(layers, positions, [0.0, 0.0], 400 + 2 * 4 * 200 - 1)
    assert plan.excess_bytes is None and plan.parts == [0, 4, 8] and plan.recompute == [1, 0]
