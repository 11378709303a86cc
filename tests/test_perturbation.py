"""The report states its perturbation: the profiled iteration against unprofiled ones of the same run,
rates from the unprofiled time, and the training log line's TFLOPs beside them (patches/profiler/perturbation.py)."""
import copy

import pytest

from patches.profiler.files import validate_report
from patches.profiler.perturbation import (
    WINDOW,
    IterationClock,
    Perturbation,
    apply_perturbation,
    counting_announcement,
    counts_before,
)
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from tests.test_profiler_report import DP, MICRO_BATCH_SIZE, MICRO_BATCHES, PP, SEQ, TP, make_meta, rank_entries

PEAK = 0.5
# Binary fractions: every product and quotient below is exact in floating point.
UNPROFILED_S, PROFILED_S = 0.75, 0.8125
LOG_LINE_FLOPS = 3.0 * 2 ** 40


@pytest.fixture
def report():
    return build_report(rank_entries(), make_meta(peak_tflops=PEAK))


def test_clock_median_of_the_iterations_before_leaving_out_warm_up():
    clock = IterationClock()
    for iteration, seconds in zip(range(1, 10), (9.0, 1.0, 3.0, 2.0, 5.0, 4.0, 7.0, 8.0, 6.0)):
        clock.record(iteration, seconds)
    assert clock.unprofiled_before(8) == (4.0, [3, 4, 5, 6, 7])  # the last WINDOW before 8
    assert WINDOW == 5
    assert clock.unprofiled_before(4) == (2.0, [2, 3])  # iteration 1, the warm-up, left out
    assert clock.unprofiled_before(2) == (9.0, [1])  # unless it is the only one
    assert clock.unprofiled_before(1) == (None, [])


def test_clock_times_the_step_and_returns_its_result():
    clock = IterationClock()
    assert clock.timed(3, lambda: "loss") == "loss"
    assert list(clock.seconds) == [3] and clock.seconds[3] >= 0.0 and clock.first == 3


def test_rates_come_from_the_unprofiled_time(report):
    profiled_rates = copy.deepcopy(report["totals"])
    assert profiled_rates["throughput_basis"] == "profiled"
    assert profiled_rates["throughput_iter_s"] == profiled_rates["iter_latency_s"]
    assert report["perturbation"] is None
    apply_perturbation(report, Perturbation(PROFILED_S, UNPROFILED_S, [2, 3, 4], LOG_LINE_FLOPS))
    totals, perturbation = report["totals"], report["perturbation"]
    measured = totals["fwd_flops"] + totals["bwd_flops"] + totals["recompute_flops"]
    assert perturbation["profiled_iter_s"] == PROFILED_S
    assert perturbation["unprofiled_iter_s"] == UNPROFILED_S
    assert perturbation["unprofiled_iterations"] == [2, 3, 4]
    assert perturbation["ratio"] == PROFILED_S / UNPROFILED_S
    assert totals["throughput_basis"] == "unprofiled" and totals["throughput_iter_s"] == UNPROFILED_S
    assert totals["tflops_per_gpu"] == measured / UNPROFILED_S / (PP * TP) / 1e12
    model_flops = totals["fwd_flops"] + totals["bwd_flops"]
    assert totals["model_tflops_per_gpu"] == model_flops / UNPROFILED_S / (PP * TP) / 1e12
    assert totals["samples_per_s"] == MICRO_BATCHES * MICRO_BATCH_SIZE * DP / UNPROFILED_S
    assert totals["tokens_per_s"] == totals["samples_per_s"] * SEQ
    assert totals["mfu"] == totals["model_tflops_per_gpu"] / PEAK
    for stage in report["stages"]:
        stage_flops = stage["fwd_flops"] + stage["bwd_flops"] + stage["recompute_flops"]
        assert stage["tflops_per_gpu"] == stage_flops / UNPROFILED_S / TP / 1e12
    # what the profiled step measured stays as it was
    for field in ("iter_latency_s", "fwd_latency_s", "bwd_latency_s", "fwd_flops", "params"):
        assert totals[field] == profiled_rates[field]
    validate_report(report)


def test_log_line_tflops_beside_the_report_and_why_they_differ(report):
    apply_perturbation(report, Perturbation(PROFILED_S, UNPROFILED_S, [2], LOG_LINE_FLOPS))
    totals, perturbation = report["totals"], report["perturbation"]
    world = PP * TP * DP
    assert perturbation["log_line_flops"] == LOG_LINE_FLOPS
    assert perturbation["log_line_tflops"] == LOG_LINE_FLOPS / (UNPROFILED_S * world) / 1e12
    # same time, same GPUs: the two rates differ by the ratio of the FLOP counts (one replica's x dp)
    measured = (totals["fwd_flops"] + totals["bwd_flops"] + totals["recompute_flops"]) * DP
    assert perturbation["log_line_tflops"] / totals["tflops_per_gpu"] == pytest.approx(LOG_LINE_FLOPS / measured,
                                                                                      rel=1e-12)
    note = perturbation["log_line_note"]
    assert f"{LOG_LINE_FLOPS / measured:.4f}" in note and "backward = 2 x forward" in note
    assert f"{perturbation['log_line_tflops']:.3g} TFLOPs" in note and f"{totals['tflops_per_gpu']:.3g}" in note
    text = format_report(report)
    assert "profiled iteration (wall, the train step):" in text
    assert "unprofiled iter time (median of iterations 2, same clock):" in text
    assert f"perturbation = profiled / unprofiled:{' ' * 35}  {PROFILED_S / UNPROFILED_S:.3f}" in text
    assert "hardware FLOPS per GPU = (fwd + bwd + recompute flops) / unprofiled iter time / (pp * tp):" in text
    assert "training log line's TFLOPs at the unprofiled iter time:" in text and note in text
    validate_report(report)


def test_without_unprofiled_iterations_the_rates_stay_the_profiled_ones(report):
    before = copy.deepcopy(report["totals"])
    apply_perturbation(report, Perturbation(PROFILED_S, None, [], LOG_LINE_FLOPS))
    assert report["totals"] == before
    perturbation = report["perturbation"]
    assert perturbation["ratio"] is None and perturbation["log_line_tflops"] is None
    assert perturbation["log_line_note"] is None
    text = format_report(report)
    assert "n/a: none ran before the profiled one" in text
    assert "/ iter latency / (pp * tp):" in text
    validate_report(report)


def test_the_counting_iteration_is_never_a_baseline():
    """--profile-flops-step N counts FLOPs in N-1 under a dispatch mode: N-1 is slowed, so the unprofiled median
    leaves it out (and the announcement says where the FLOPs are counted)."""
    clock = IterationClock()
    for iteration, seconds in zip(range(1, 5), (9.0, 1.0, 3.0, 7.0)):
        clock.record(iteration, seconds)
    clock.mark_perturbed(4)
    assert clock.unprofiled_before(5) == (2.0, [2, 3])
    assert counts_before(5, "previous", 4) and not counts_before(5, "previous", 3)
    assert not counts_before(5, "profiled", 4) and not counts_before(None, "previous", 4)
    assert counting_announcement(5, "previous", 0) == ", its FLOPs counted in iteration 4"
    assert counting_announcement(5, "previous", 4) == ", its FLOPs counted in it"  # resumed after iteration 4
    assert counting_announcement(1, "previous", 0) == ", its FLOPs counted in it"
    assert counting_announcement(5, "profiled", 0) == ", its FLOPs counted in it"
    assert counting_announcement(5, "previous", None) == (
        ", its FLOPs counted in iteration 4 (in it if this run starts at iteration 5)")


def test_report_says_where_the_flops_were_counted():
    counted_itself = build_report(rank_entries(), make_meta())  # step 7, counted in it
    assert counted_itself["flops_counting"] == {
        "counted_iteration": 7, "calls_differ": [],
        "note": "counted in iteration 7 itself, by a dispatch mode on its timed path"}
    entries = rank_entries()
    for entry in entries:
        entry["counted_iteration"], entry["calls_differ"] = 6, []
    entries[1]["calls_differ"] = ["3.mlp: fwd 4/5"]
    report = build_report(entries, make_meta())
    validate_report(report)
    assert report["flops_counting"]["counted_iteration"] == 6
    assert report["flops_counting"]["calls_differ"] == [f"rank {entries[1]['global_rank']}: 3.mlp: fwd 4/5"]
    assert report["flops_counting"]["note"] == (
        "counted in iteration 6 by a dispatch mode, so that iteration 7 ran without one; its module calls or their "
        "input shapes differ from iteration 6's in 1 places (calls_differ): the FLOPs are iteration 6's")
    assert "flops counted:" in format_report(report) and report["flops_counting"]["note"] in format_report(report)
    entries[0]["counted_iteration"] = None  # this rank counted in the profiled iteration itself
    mixed = build_report(entries, make_meta())
    validate_report(mixed)
    assert mixed["flops_counting"]["counted_iteration"] is None
    counted_before = sorted(e["global_rank"] for e in entries[1:] if e["dp_rank"] == 0)
    assert mixed["flops_counting"]["note"].startswith(
        f"counted by a dispatch mode in iteration 6 on ranks {counted_before}; "
        f"in iteration 7 on ranks [{entries[0]['global_rank']}]")
