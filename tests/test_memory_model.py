"""partition/memory_model.py: each stage's predicted memory peak for any partition, from a report's terms, against
sums done by hand."""
import json
import random

import pytest

from patches.partition.memory_model import (
    LayerMemory,
    PositionMemory,
    RangeLargest,
    memory_terms_of,
    positions_for,
    predict_peaks,
    stage_peak,
    with_step_floor,
)
from tests.helpers.golden import GOLDEN

# Four layers: an embedding (much state, small activations), two blocks, a head (big activations).
LAYERS = [LayerMemory(0, state_bytes=4000, activation_bytes=10), LayerMemory(1, 1000, 300),
          LayerMemory(2, 1000, 300), LayerMemory(3, 2000, 50)]
FIRST = PositionMemory(base_bytes=100, outside_layers_bytes=20, in_flight_micro_batches=2,
                       compute_transient_bytes=30, step_transient_bytes=5000, step_state_bytes=5000)
LAST = PositionMemory(base_bytes=700, outside_layers_bytes=400, in_flight_micro_batches=1,
                      compute_transient_bytes=900, step_transient_bytes=1500, step_state_bytes=3000)


def test_a_stage_peak_is_its_compute_or_its_step():
    # compute: 100 + 5000 + 2 x (310 + 20) + 30 = 5790; step: 100 + 5000 + 5000 x 5000 / 5000 = 10100
    peak = stage_peak(5000, 310, FIRST)
    assert (peak.compute_peak_bytes, peak.step_peak_bytes, peak.predicted_peak_bytes) == (5790, 10100, 10100)
    assert peak.activation_bytes == 330 and peak.state_bytes == 5000


def test_the_partition_that_ran_and_another():
    ran = predict_peaks(LAYERS, [FIRST, LAST], [0, 2, 4], micro_batches=8)
    # stage 1: state 3000, activations 350 + 400; compute 700 + 3000 + 750 + 900 = 5350; step 700 + 3000 + 1500
    assert [p.predicted_peak_bytes for p in ran] == [10100, 5350]
    moved = predict_peaks(LAYERS, [FIRST, LAST], [0, 1, 4], micro_batches=8)
    # stage 0: state 4000; compute 100 + 4000 + 2 x 30 + 30 = 4190; step 100 + 4000 + 5000 x 4000 // 5000 = 8100
    # stage 1: state 4000, activations 650 + 400; compute 700 + 4000 + 1050 + 900 = 6650; step 700 + 4000 + 2000
    assert [(p.compute_peak_bytes, p.step_peak_bytes) for p in moved] == [(4190, 8100), (6650, 6700)]
    assert [p.predicted_peak_bytes for p in moved] == [8100, 6700]


def test_another_number_of_stages_keeps_the_ends_and_takes_1f1b_in_flight():
    middle = PositionMemory(50, 20, 2, 10, 100, 1000)
    three = [FIRST, middle, LAST]
    four = positions_for(three, 4, micro_batches=3)
    assert [p.in_flight_micro_batches for p in four] == [3, 3, 2, 1]  # min(pp - s, m)
    assert [p.base_bytes for p in four] == [100, 50, 50, 700]
    assert [p.base_bytes for p in positions_for([FIRST, LAST], 3, 8)] == [100, 100, 700]
    assert positions_for([FIRST, LAST], 1, 8) == [PositionMemory(700, 400, 1, 900, 1500, 3000)]
    peaks = predict_peaks(LAYERS, [FIRST, LAST], [0, 1, 2, 3, 4], micro_batches=8)
    # stage 2 (a middle one, the first's terms, 2 in flight): 100 + 1000 + 2 x 320 + 30 = 1770; step 100 + 1000
    # + 5000 x 1000 // 5000 = 2100
    assert peaks[2].predicted_peak_bytes == 2100 and peaks[2].compute_peak_bytes == 1770
    assert peaks[1].compute_peak_bytes == 100 + 1000 + 3 * 320 + 30  # 4 - 1 in flight


# ZeRO's stage 0 in miniature: a step transient of 4100, 4000 of it reduction buckets (fixed), the other 100 the
# optimizer's temporaries for a state of 5000; the buckets took the place of 0 gradient bytes here.
ZERO_FIRST = PositionMemory(base_bytes=100, outside_layers_bytes=20, in_flight_micro_batches=2,
                            compute_transient_bytes=30, step_transient_bytes=4100, step_state_bytes=5000,
                            fixed_buffer_bytes=4000)


def test_fixed_buffers_stay_with_the_position_and_only_the_rest_scales():
    # as it ran: 100 + 5000 + 4000 + 100 x 5000 // 5000 = 9200, the step transient unscaled
    assert stage_peak(5000, 310, ZERO_FIRST).step_peak_bytes == 100 + 5000 + 4100 == 9200
    # with one layer (state 4000): 100 + 4000 + 4000 + 100 x 4000 // 5000 = 8180 (all of it scaled: 7380)
    moved = predict_peaks(LAYERS, [ZERO_FIRST, LAST], [0, 1, 4], micro_batches=8)
    assert moved[0].step_peak_bytes == 8180 and moved[0].predicted_peak_bytes == 8180
    # with three layers (state 6000): 100 + 6000 + 4000 + 100 x 6000 // 5000 = 10220
    assert predict_peaks(LAYERS, [ZERO_FIRST, LAST], [0, 3, 4], 8)[0].step_peak_bytes == 10220
    # the rest may be negative (gradients let go once copied into a bucket); it scales all the same, rounded down:
    # 100 + 4000 + 4000 + (-300 x 4000 // 5000 = -240) = 7860
    freed = PositionMemory(100, 20, 2, 30, 3700, 5000, fixed_buffer_bytes=4000)
    assert stage_peak(4000, 10, freed).step_peak_bytes == 7860
    # other numbers of stages keep each position's fixed buffers
    assert [p.fixed_buffer_bytes for p in positions_for([ZERO_FIRST, LAST], 3, 8)] == [4000, 4000, 0]


def test_a_report_without_fixed_buffers_plans_as_before():
    """A report from before fixed_buffer_bytes was measured: 0, the step transient all scaled."""
    report = json.loads((GOLDEN / "fork.report.json").read_text())
    for stage in report["stages"]:
        del stage["memory"]["fixed_buffer_bytes"]
    layers, positions = memory_terms_of(report)
    assert [p.fixed_buffer_bytes for p in positions] == [0, 0]
    assert memory_terms_of(json.loads((GOLDEN / "fork.report.json").read_text())) == (layers, positions)


def test_bad_parts_and_an_unknown_schedule_elsewhere_are_refused():
    with pytest.raises(ValueError, match=r"parts \[0, 2, 2, 4\] do not cut 4 layers"):
        predict_peaks(LAYERS, [FIRST, LAST], [0, 2, 2, 4], 8)
    with pytest.raises(ValueError, match="ZeroBubbleH1Pipeline"):
        predict_peaks(LAYERS, [FIRST, LAST], [0, 1, 2, 4], 8, schedule="ZeroBubbleH1Pipeline")
    assert len(predict_peaks(LAYERS, [FIRST, LAST], [0, 1, 4], 8, schedule="ZeroBubbleH1Pipeline")) == 2


def test_a_reports_terms_give_back_its_own_predicted_peaks():
    report = json.loads((GOLDEN / "fork.report.json").read_text())
    layers, positions = memory_terms_of(report)
    parts = report["partition_plan"]["current_parts"]
    peaks = predict_peaks(layers, positions, parts, report["parallelism"]["micro_batches"])
    assert [p.predicted_peak_bytes for p in peaks] == [s["memory"]["predicted_peak_bytes"] for s in report["stages"]]
    assert [p.state_bytes for p in peaks] == [s["memory"]["state_bytes"] for s in report["stages"]]


def test_a_report_without_memory_has_no_terms():
    report = json.loads((GOLDEN / "fork.report.json").read_text())
    for stage in report["stages"]:
        stage["memory"] = None
    assert memory_terms_of(report) is None


def test_a_recompute_adds_its_rise_to_the_backwards_own():
    """A recompute's rise (StageOptions._rise) comes on top of the backward's own; a position where the run recomputed
    holds the run's rise in its measured transient, taken out before another choice's is added."""
    plain = PositionMemory(base_bytes=0, outside_layers_bytes=0, in_flight_micro_batches=1,
                           compute_transient_bytes=1000, step_transient_bytes=0, step_state_bytes=0)
    assert stage_peak(0, 0, plain, 400).compute_peak_bytes == 1400
    recomputed = PositionMemory(0, 0, 1, 1400, 0, 0, recomputed_transient_bytes=400)
    assert stage_peak(0, 0, recomputed, 400).compute_peak_bytes == 1400  # as it ran
    assert stage_peak(0, 0, recomputed, 0).compute_peak_bytes == 1000
    assert stage_peak(0, 0, recomputed, 700).compute_peak_bytes == 1700
    # the head's logits are gone before any layer's backward: the larger of the two
    last = PositionMemory(0, 0, 1, 1000, 0, 0, holds_the_loss=True)
    assert stage_peak(0, 0, last, 400).compute_peak_bytes == 1000
    assert stage_peak(0, 0, last, 1300).compute_peak_bytes == 1300


# An optimizer that updates one tensor at a time: its own step held 4600 beyond base and state on the first stage,
# whose largest parameter (the embedding's, 2000 bytes) it makes temporaries of (2.3 per byte), and 900 on the last
# (largest 300: 3 per byte). The floor is the least: 4600 per 2000 bytes of a stage's largest parameter.
LARGEST = [LayerMemory(0, 4000, 10, largest_param_bytes=2000), LayerMemory(1, 1000, 300, 300),
           LayerMemory(2, 1000, 300, 300), LayerMemory(3, 2000, 50, 300)]


def test_the_optimizers_step_keeps_its_temporaries_of_the_largest_parameter():
    floored = with_step_floor([FIRST, LAST], [4600, 900], [2000, 300])
    assert [(p.step_floor_bytes, p.step_floor_param_bytes) for p in floored] == [(4600, 2000), (4600, 2000)]
    # the embedding alone: the step transient scaled to its state is 5000 x 4000 // 5000 = 4000, but the optimizer
    # still makes its temporaries of the embedding: 4600 x 2000 // 2000 = 4600; step 100 + 4000 + 4600 = 8700
    alone = predict_peaks(LARGEST, floored, [0, 1, 4], micro_batches=8)
    assert alone[0].step_peak_bytes == 8700
    assert predict_peaks(LARGEST, [FIRST, LAST], [0, 1, 4], micro_batches=8)[0].step_peak_bytes == 8100  # no floor
    # stage 1 (largest 300): the floor, 4600 x 300 // 2000 = 690, is below the scaled 1500 x 4000 // 3000 = 2000
    assert alone[1].step_peak_bytes == 700 + 4000 + 2000
    # the parts that ran: the floor is at most each stage's own optimizer transient, so nothing moves
    ran = predict_peaks(LARGEST, floored, [0, 2, 4], micro_batches=8)
    assert [p.predicted_peak_bytes for p in ran] == [p.predicted_peak_bytes for p in predict_peaks(
        LAYERS, [FIRST, LAST], [0, 2, 4], micro_batches=8)]


def test_no_floor_where_the_optimizers_own_transient_is_not_known_or_not_positive():
    assert with_step_floor([FIRST, LAST], [None, 900], [2000, 300]) == [FIRST, LAST]  # a report from before
    assert with_step_floor([FIRST, LAST], [4600, 900], [2000, 0]) == [FIRST, LAST]  # a stage without parameters
    zero = PositionMemory(100, 20, 2, 30, 4100, 5000, fixed_buffer_bytes=4000)
    assert with_step_floor([zero, LAST], [3900, 900], [2000, 300]) == [zero, LAST]  # ZeRO: buckets, gradients gone


def test_a_reports_floor_comes_from_its_stages_and_layers():
    report = json.loads((GOLDEN / "fork.report.json").read_text())
    assert all(p.step_floor_param_bytes == 0 for p in memory_terms_of(report)[1])  # recorded before it was measured
    for stage, transient in zip(report["stages"], (61440, 49152)):
        stage["memory"]["optimizer_step_transient_bytes"] = transient
    layers, positions = memory_terms_of(report)
    # largest parameters: the embedding's 12288 bytes on both stages (the head is tied to it); 49152 / 12288 = 4
    assert [layer.largest_param_bytes for layer in layers] == [12288, 8192, 8192, 8192, 8192, 128, 12288]
    assert [(p.step_floor_bytes, p.step_floor_param_bytes) for p in positions] == [(49152, 12288)] * 2


def test_the_largest_over_a_range_is_the_largest_of_its_values():
    rng = random.Random(3)
    for n in (1, 2, 5, 16, 33):
        values = [rng.randint(0, 1000) for _ in range(n)]
        largest = RangeLargest(values)
        for first in range(n):
            for stop in range(first, n + 1):
                assert largest.of(first, stop) == max(values[first:stop], default=0)
