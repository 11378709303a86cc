"""The report states its perturbation: the profiled iteration against unprofiled ones of the same run, rates
from the unprofiled time, and the training log line's TFLOPs beside them (report.build_report, from the context's
IterationTiming); the schedule that decides which iteration counts, which is profiled and which is timed, and its
clock (patches/profiler/one_step.py)."""
import pytest

from patches.partition.measured_run import Basis
from patches.profiler.context import IterationTiming
from patches.profiler.files import validate_report
from patches.profiler.iteration_clock import WINDOW, Baseline, IterationClock
from patches.profiler.one_step import COUNT, PROFILE, TIME, ProfileSchedule, counting_announcement
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from patches.profiler.report_timing import plan_basis
from tests.test_profiler_report import DP, MICRO_BATCH_SIZE, MICRO_BATCHES, PP, SEQ, TP, make_context, rank_entries

PEAK = 0.5
# Binary fractions: every product and quotient below is exact in floating point.
UNPROFILED_S, PROFILED_S = 0.75, 0.8125
LOG_LINE_FLOPS = 3.0 * 2 ** 40


@pytest.fixture
def report():
    return build_report(rank_entries(), make_context(peak_tflops=PEAK))


def timed_report(unprofiled_s, iterations, peak_tflops=PEAK):
    timing = IterationTiming(PROFILED_S, unprofiled_s, iterations)
    return build_report(rank_entries(), make_context(peak_tflops=peak_tflops, timing=timing,
                                                     log_line_flops=LOG_LINE_FLOPS))


def test_clock_median_of_the_iterations_before_leaving_out_warm_up():
    clock = IterationClock()
    for iteration, seconds in zip(range(1, 10), (9.0, 1.0, 3.0, 2.0, 5.0, 4.0, 7.0, 8.0, 6.0)):
        clock.record(iteration, seconds)
    assert clock.unprofiled_before(8) == (4.0, [3, 4, 5, 6, 7])  # the last WINDOW before 8
    assert WINDOW == 5
    assert clock.unprofiled_before(4) == (2.0, [2, 3])  # iteration 1, the warm-up, left out
    assert clock.unprofiled_before(2) == (9.0, [1])  # unless it is the only one
    assert clock.unprofiled_before(1) == (None, [])


def test_the_baseline_is_the_steady_iterations_after_the_profiled_one_where_they_ran():
    clock = IterationClock()
    for iteration, seconds in ((1, 9.0), (2, 4.0), (3, 5.0), (4, 2.0), (5, 3.0), (6, 2.5)):
        clock.record(iteration, seconds)
    clock.mark_perturbed(2)  # the counting pass
    clock.mark_perturbed(3)  # the profiled iteration
    assert clock.baseline(3) == Baseline(2.5, [4, 5, 6], (3.0 - 2.0) / 2.5, None)
    for iteration in range(7, 12):
        clock.record(iteration, 1.0)
    assert clock.baseline(3).iterations == [4, 5, 6, 7, 8]  # up to WINDOW


def test_a_baseline_of_the_warm_up_alone_or_of_nothing_says_so():
    clock = IterationClock()
    clock.record(1, 9.0)
    clock.record(2, 4.0)
    clock.mark_perturbed(2)
    warm_up = clock.baseline(2)
    assert (warm_up.median_s, warm_up.iterations, warm_up.spread) == (9.0, [1], None)
    assert warm_up.note.startswith("the only unprofiled iteration timed is iteration 1, the run's first: it includes "
                                   "warm-up")
    assert clock.baseline(1) == Baseline(None, [], None, "no unprofiled iteration was timed: the rates are over the "
                                                          "profiled iteration")
    before = IterationClock()
    for iteration in (1, 2, 3):
        before.record(iteration, float(iteration))
    assert before.baseline(4) == Baseline(2.5, [2, 3], 1 / 2.5, None)  # past the warm-up: steady enough, unsaid


def test_the_plan_scales_its_times_to_a_steady_baseline_and_says_when_it_cannot():
    steady = IterationTiming(2.0, 1.6, [4, 5, 6], unprofiled_spread=0.05)
    assert plan_basis(steady) == Basis(0.8, (4, 5, 6), 0.05, None)
    warm_up = IterationTiming(2.0, 3.0, [1], baseline_note="warm-up")
    assert plan_basis(warm_up) == Basis(1.0, (1,), None, "warm-up")  # not scaled to a warm-up iteration
    assert plan_basis(None) == Basis(note="no iteration was timed unprofiled")
    report = build_report(rank_entries(), make_context(timing=IterationTiming(2.5, 2.0, [4, 5, 6],
                                                                              unprofiled_spread=0.1)))
    assert report["perturbation"]["warming_up_note"].startswith("the profiled iteration took 1.25x the steady "
                                                                "unprofiled ones: it was still warming up")
    quick = build_report(rank_entries(), make_context(timing=IterationTiming(2.1, 2.0, [4, 5, 6])))
    assert quick["perturbation"]["warming_up_note"] is None  # 5% is the profiler's own cost


def test_clock_times_the_step_and_returns_its_result():
    clock = IterationClock()
    assert clock.timed(3, lambda: "loss") == "loss"
    assert list(clock.seconds) == [3] and clock.seconds[3] >= 0.0 and clock.first == 3


def test_rates_come_from_the_unprofiled_time(report):
    profiled_rates = report["totals"]
    assert profiled_rates["throughput_basis"] == "profiled"
    assert profiled_rates["throughput_iter_s"] == profiled_rates["iter_latency_s"]
    assert report["perturbation"] is None
    report = timed_report(UNPROFILED_S, [2, 3, 4])
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


def test_log_line_tflops_beside_the_report_and_why_they_differ():
    report = timed_report(UNPROFILED_S, [2])
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
    before = report["totals"]
    report = timed_report(None, [])
    assert report["totals"] == before
    perturbation = report["perturbation"]
    assert perturbation["ratio"] is None and perturbation["log_line_tflops"] is None
    assert perturbation["log_line_note"] is None
    text = format_report(report)
    assert "n/a: none was timed" in text
    assert "/ iter latency / (pp * tp):" in text
    validate_report(report)


def schedule(profile_step, counting="previous", shapes_change=None):
    return ProfileSchedule(profile_step, counting=counting, shapes_change=shapes_change)


def test_the_schedule_counts_in_the_iteration_before_profiles_one_and_times_the_rest():
    """The rule, once: N-1 counts, N is profiled, every other iteration (all of them without a profile step) is
    timed; counting 'profiled' counts in N itself, so N-1 is only timed."""
    assert [schedule(5).role(i) for i in range(1, 8)] == [TIME, TIME, TIME, COUNT, PROFILE, TIME, TIME]
    assert [schedule(5, "profiled").role(i) for i in (4, 5)] == [TIME, PROFILE]
    assert [schedule(None).role(i) for i in (0, 1, 4)] == [TIME, TIME, TIME]
    assert [schedule(0).role(i) for i in (-1, 0, 1)] == [COUNT, PROFILE, TIME]  # DeepSpeed's numbering: -1 never runs
    with pytest.raises(ValueError, match="counting must be one of"):
        schedule(5, "before")


def test_a_run_whose_shapes_change_counts_in_the_profiled_iteration_and_says_why():
    """Curriculum learning grows the sequence between iterations: N-1's FLOPs are not N's, so N counts itself."""
    changing = schedule(5, shapes_change="curriculum learning")
    assert [changing.role(i) for i in (4, 5)] == [TIME, PROFILE]
    assert changing.counting_note == "the run changes its shapes between iterations: curriculum learning"
    assert schedule(5, "profiled", shapes_change="curriculum learning").counting_note is None  # as asked: no why
    assert counting_announcement(5, "previous", 0, "curriculum learning") == (
        ", its FLOPs counted in it (the run changes its shapes between iterations: curriculum learning)")
    counted_itself = build_report(rank_entries(), make_context())["flops_counting"]["note"]
    noted = build_report(rank_entries(), make_context(counting_note=changing.counting_note))["flops_counting"]["note"]
    assert noted == counted_itself + " (the run changes its shapes between iterations: curriculum learning)"


def test_the_schedule_times_each_unprofiled_iteration_on_its_clock():
    timed = schedule(5)
    assert [timed.run(None, None, i, lambda i=i: i * 10) for i in (1, 2, 3)] == [(10, None), (20, None), (30, None)]
    assert sorted(timed.clock.seconds) == [1, 2, 3] and timed.clock.first == 1


def test_the_counting_iteration_is_never_a_baseline():
    """--profile-flops-step N counts FLOPs in N-1 under a dispatch mode: N-1 is slowed, so the unprofiled median
    leaves it out (and the announcement says where the FLOPs are counted)."""
    clock = IterationClock()
    for iteration, seconds in zip(range(1, 5), (9.0, 1.0, 3.0, 7.0)):
        clock.record(iteration, seconds)
    clock.mark_perturbed(4)
    assert clock.unprofiled_before(5) == (2.0, [2, 3])
    assert counting_announcement(5, "previous", 0) == ", its FLOPs counted in iteration 4"
    assert counting_announcement(5, "previous", 4) == ", its FLOPs counted in it"  # resumed after iteration 4
    assert counting_announcement(1, "previous", 0) == ", its FLOPs counted in it"
    assert counting_announcement(5, "profiled", 0) == ", its FLOPs counted in it"
    assert counting_announcement(5, "previous", None) == (
        ", its FLOPs counted in iteration 4 (in it if this run starts at iteration 5)")


def test_report_says_where_the_flops_were_counted():
    counted_itself = build_report(rank_entries(), make_context())  # step 7, counted in it
    assert counted_itself["flops_counting"] == {
        "counted_iteration": 7, "calls_differ": [],
        "note": "counted in iteration 7 itself, by a dispatch mode on its timed path"}
    entries = rank_entries()
    for entry in entries:
        entry["counted_iteration"], entry["calls_differ"] = 6, []
    entries[1]["calls_differ"] = ["3.mlp: fwd 4/5"]
    report = build_report(entries, make_context())
    validate_report(report)
    assert report["flops_counting"]["counted_iteration"] == 6
    assert report["flops_counting"]["calls_differ"] == [f"rank {entries[1]['global_rank']}: 3.mlp: fwd 4/5"]
    assert report["flops_counting"]["note"] == (
        "counted in iteration 6 by a dispatch mode, so that iteration 7 ran without one; its module calls or their "
        "input shapes differ from iteration 6's in 1 places (calls_differ): the FLOPs are iteration 6's")
    assert "flops counted:" in format_report(report) and report["flops_counting"]["note"] in format_report(report)
    entries[0]["counted_iteration"] = None  # this rank counted in the profiled iteration itself
    mixed = build_report(entries, make_context())
    validate_report(mixed)
    assert mixed["flops_counting"]["counted_iteration"] is None
    counted_before = sorted(e["global_rank"] for e in entries[1:] if e["dp_rank"] == 0)
    assert mixed["flops_counting"]["note"].startswith(
        f"counted by a dispatch mode in iteration 6 on ranks {counted_before}; "
        f"in iteration 7 on ranks [{entries[0]['global_rank']}]")
