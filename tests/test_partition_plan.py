"""The partition planner (patches/partition/planner.py) on synthetic layer costs whose best contiguous partition
is known: exact boundaries, ties, a layer heavier than a fair share, and against every partition by brute force."""
import itertools
import random

import pytest

from patches.partition.measured_run import Basis, MeasuredRun
from patches.partition.plan_lines import plan_line
from patches.partition.planner import (
    LayerCost,
    balanced_parts,
    least_peak_parts,
    memory_bounded_parts,
    model_iter_s,
    plan,
    predict,
)
from patches.partition.report_plan import PlanRequest, gain_within_spread, plan_from_table


def brute_force(costs, stages, overheads=None):
    """Every contiguous partition into non-empty parts; the smallest by (sorted-descending loads, boundaries)."""
    n = len(costs)
    overheads = overheads or [0.0] * stages
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        parts = [0, *cuts, n]
        loads = tuple(sorted((sum(costs[parts[s]:parts[s + 1]]) + overheads[s] for s in range(stages)),
                             reverse=True))
        if best is None or (loads, parts) < best:
            best = (loads, parts)
    return best[1]


def test_a_known_best_partition():
    # 8 equal layers and a head worth 4 of them: the head's stage gets few layers
    assert balanced_parts([1, 1, 1, 1, 1, 1, 1, 1, 4], 2) == [0, 6, 9]  # loads 6 and 6
    assert balanced_parts([1, 1, 1, 1, 1, 1, 1, 1, 4], 3) == [0, 4, 8, 9]  # loads 4, 4, 4: the head alone


def test_a_layer_heavier_than_a_fair_share_gets_a_stage_of_its_own_and_the_rest_is_balanced():
    # total 20, fair share 5; the 10 bounds every partition, and the other stages split the rest evenly
    assert balanced_parts([1, 1, 10, 1, 1, 1, 1, 1, 1, 1, 1], 3) == [0, 2, 3, 11]
    assert balanced_parts([1, 1, 10, 1, 1, 1, 1, 1, 1, 1, 1], 4) == [0, 2, 3, 7, 11]


def test_ties_go_to_the_second_largest_load_then_the_earliest_boundaries():
    # [2, 1, 1, 2] in 2: [2, 1 | 1, 2] (3, 3) beats every other
    assert balanced_parts([2, 1, 1, 2], 2) == [0, 2, 4]
    # all equal: [1 | 1, 1 | 1, 1], [1, 1 | 1 | 1, 1] and [1, 1 | 1, 1 | 1] all sort to (2, 2, 1): the earliest
    assert balanced_parts([1, 1, 1, 1, 1], 3) == [0, 1, 3, 5]
    # the largest load ties at 5; the second largest decides: [5 | 2 | 2, 1] sorts to (5, 3, 2), smaller than
    # [5 | 2, 2 | 1]'s (5, 4, 1)
    assert balanced_parts([5, 2, 2, 1], 3) == [0, 1, 2, 4]


def test_a_stage_positions_overhead_stays_with_it():
    # the last stage carries the loss, worth 2 layers: it gets 2 layers, the first 4 (loads 4 and 4)
    assert balanced_parts([1, 1, 1, 1, 1, 1], 2, overheads=[0, 2]) == [0, 4, 6]
    assert balanced_parts([1, 1, 1, 1, 1, 1], 2) == [0, 3, 6]


@pytest.mark.parametrize("seed", range(30))
def test_the_dynamic_programme_is_the_brute_force(seed):
    generator = random.Random(seed)
    n, stages = generator.randint(2, 9), generator.randint(1, 4)
    stages = min(stages, n)
    costs = [generator.choice([0.5, 1.0, 1.5, 2.0, 3.0, 8.0]) for _ in range(n)]
    overheads = [generator.choice([0.0, 0.5, 2.0]) for _ in range(stages)]
    assert balanced_parts(costs, stages, overheads) == brute_force(costs, stages, overheads)


def test_no_empty_stage_and_bad_requests_refused():
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 non-empty stages"):
        balanced_parts([1, 1], 3)


def test_the_prediction_keeps_what_the_model_leaves_out():
    """1F1B with m micro-batches: sum(t) + (m - 1) max(t); the measured iteration's rest is added unchanged."""
    assert model_iter_s([4.0, 8.0], 4) == 1 + 2 + 3 * 2
    layers = [LayerCost(i, "Layer", 0 if i < 3 else 1, seconds) for i, seconds in enumerate([1, 1, 1, 1, 1, 3])]
    # ran [0, 3, 6]: loads 3 and 5 (+ 1 of loss on the last stage): model 3/2 + 6/2 + 1 * 6/2 = 7.5; measured 9
    result = plan(layers, [0, 3, 6], overhead_s=[0.0, 1.0], measured_iter_s=9.0, micro_batches=2)
    assert result.parts == [0, 4, 6] and result.stage_s == [4.0, 5.0] and result.bound_s == 5.0
    assert result.predicted_iter_s == (2.0 + 2.5 + 2.5) + (9.0 - 7.5)


def test_any_partition_is_predicted_by_the_same_model():
    """predict: the partition of one's choice, by the model plan uses; plan's own parts predict plan's figures."""
    layers = [LayerCost(i, "Layer", 0 if i < 3 else 1, seconds) for i, seconds in enumerate([1, 1, 1, 1, 1, 3])]
    measured = dict(current_parts=[0, 3, 6], overhead_s=[0.0, 1.0], measured_iter_s=9.0, micro_batches=2)
    assert predict(layers, parts=[0, 4, 6], **measured) == plan(layers, **measured)
    # the partition that ran predicts what was measured
    assert predict(layers, parts=[0, 3, 6], **measured).predicted_iter_s == 9.0
    # [0, 5, 6]: loads 5 and 4; model 5/2 + 4/2 + 5/2 = 7 (+ 1.5 not modelled)
    assert predict(layers, parts=[0, 5, 6], **measured).predicted_iter_s == 7.0 + 1.5
    # one stage holds everything and the loss: load 9, model 9/2 + 9/2 = 9
    assert predict(layers, parts=[0, 6], **measured).predicted_iter_s == 9.0 + 1.5
    for bad in ([0, 3, 3, 6], [1, 6], [0, 7], [0]):
        with pytest.raises(ValueError, match="do not cut 6 layers into non-empty stages"):
            predict(layers, parts=bad, **measured)


# ---------------------------------------------------------------- under a memory limit
# Four layers of equal cost, cut in 2. A stage's peak, by hand: stage 0 keeps 2 micro-batches in flight, stage 1
# one, so peak(0, a, b) = sum(state[a:b]) + 2 x sum(kept[a:b]), peak(1, a, b) = sum(state[a:b]) + sum(kept[a:b]).
STATE, KEPT = [100, 100, 100, 100], [100, 1000, 100, 100]


def hand_peak(stage, first, stop):
    return sum(STATE[first:stop]) + (2 if stage == 0 else 1) * sum(KEPT[first:stop])


# [0, 1, 4]: 100 + 200 = 300 and 300 + 1200 = 1500; [0, 2, 4]: 200 + 2200 = 2400 and 200 + 200 = 400;
# [0, 3, 4]: 300 + 2400 = 2700 and 100 + 100 = 200. By time [0, 2, 4] (loads 2 and 2) is the best.
def test_the_time_optimal_partition_over_the_limit_gives_way_to_one_within_it():
    costs = [1.0, 1.0, 1.0, 1.0]
    assert balanced_parts(costs, 2) == [0, 2, 4]
    assert memory_bounded_parts(costs, 2, None, hand_peak, 2400) == ([0, 2, 4], None)  # within: <= the limit
    assert memory_bounded_parts(costs, 2, None, hand_peak, 2399) == ([0, 1, 4], None)  # only [0, 1, 4] fits
    assert memory_bounded_parts(costs, 2, None, hand_peak, 1500) == ([0, 1, 4], None)


def test_no_partition_fits_the_closest_and_its_excess_exactly():
    assert least_peak_parts(hand_peak, 4, 2) == ([0, 1, 4], 1500)
    assert memory_bounded_parts([1.0] * 4, 2, None, hand_peak, 1499) == ([0, 1, 4], 1)
    assert memory_bounded_parts([1.0] * 4, 2, None, hand_peak, 1000) == ([0, 1, 4], 500)
    assert balanced_parts([1.0] * 4, 2, fits=lambda stage, first, stop: False) is None


def test_among_the_closest_the_fastest():
    # Both [0, 1, 4] and [0, 3, 4] peak at 30 at most, [0, 2, 4] at 40; by time [0, 3, 4] is the better of the two
    peaks = {(0, 0, 1): 10, (1, 1, 4): 30, (0, 0, 2): 40, (1, 2, 4): 10, (0, 0, 3): 30, (1, 3, 4): 10}

    def peak(*stage_first_stop):  # a stage that does not end at the last layer is never part of a partition
        return peaks.get(stage_first_stop, 1000)

    assert least_peak_parts(peak, 4, 2) == ([0, 1, 4], 30)  # ties: the earliest boundaries
    assert memory_bounded_parts([1.0, 1.0, 1.0, 3.0], 2, None, peak, 20) == ([0, 3, 4], 10)


@pytest.mark.parametrize("seed", range(30))
def test_the_memory_bounded_programme_is_the_brute_force(seed):
    generator = random.Random(seed)
    n = generator.randint(2, 8)
    stages = min(generator.randint(1, 4), n)
    costs = [generator.choice([0.5, 1.0, 2.0, 8.0]) for _ in range(n)]
    sizes = [generator.randint(1, 9) for _ in range(n)]
    in_flight = [stages - s for s in range(stages)]

    def peak(stage, first, stop):
        return in_flight[stage] * sum(sizes[first:stop])

    limit = generator.randint(5, 40)
    cuts = [[0, *c, n] for c in itertools.combinations(range(1, n), stages - 1)]
    largest = {tuple(p): max(peak(s, p[s], p[s + 1]) for s in range(stages)) for p in cuts}
    least = min(largest.values())
    within = [p for p in cuts if largest[tuple(p)] <= max(limit, least)]
    loads = {tuple(p): tuple(sorted((sum(costs[p[s]:p[s + 1]]) for s in range(stages)), reverse=True)) for p in cuts}
    expected = min(within, key=lambda p: (loads[tuple(p)], p))
    assert memory_bounded_parts(costs, stages, None, peak, limit) == (
        expected, None if least <= limit else least - limit)


def test_a_gain_within_the_spread_of_its_iterations_is_said_to_be_unsupported():
    # 5% faster predicted over iterations that spread 6%: the measurements cannot tell it from their own variation;
    # 7% over the same 6% they can; a plan that moves nothing or is slower, or a basis without a measured spread,
    # says neither
    steady = Basis(0.8, (4, 5, 6), 0.06)
    assert gain_within_spread(-0.05, True, steady) is True
    assert gain_within_spread(-0.06, True, steady) is True
    assert gain_within_spread(-0.07, True, steady) is False
    assert gain_within_spread(-0.05, False, steady) is None
    assert gain_within_spread(0.49, True, steady) is None  # slower (a memory limit forced it): no gain to doubt
    assert gain_within_spread(-0.05, True, Basis(1.0, (1,), None)) is None
    assert gain_within_spread(-0.05, True, Basis(1.0, (1,), 0.06, note="the warm-up alone")) is None
    layers = [{"index": i, "type": "L", "stage": i // 2, "fwd_latency_s": s, "bwd_latency_s": 0.0,
               "recompute_latency_s": 0.0} for i, s in enumerate([1.0, 1.0, 0.5, 0.4])]
    # scaled by 0.8, the loads as ran are 1.6 and 0.72 s, [0, 1, 4]'s 0.8 and 1.52: per micro-batch (4 of them)
    # the 1F1B model moves from 0.58 + 3 x 0.4 = 1.78 to 0.58 + 3 x 0.38 = 1.72 s, so 10 s measured -> 9.94, -0.6%
    planned = plan_from_table(MeasuredRun(layers, [0, 2, 4], [0.0, 0.0], 10.0, 4, steady), PlanRequest())
    assert planned["parts"] == [0, 1, 4] and planned["predicted_iter_s"] == pytest.approx(9.94, abs=1e-12)
    words = "; the gain is within that spread, so these measurements cannot tell it from noise"
    assert planned["gain_within_spread"] is True and plan_line(planned).endswith(words)
    planned = plan_from_table(MeasuredRun(layers, [0, 2, 4], [0.0, 0.0], 10.0, 4, Basis(0.8, (4, 5, 6), 0.005)),
                              PlanRequest())
    assert planned["gain_within_spread"] is False and words not in plan_line(planned)
