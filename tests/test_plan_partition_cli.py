"""megatron-plan-partition (patches/cli/plan_partition.py) on a real report (the golden fork run's: our GPT at
pp 2 x tp 2) and on a small one whose numbers add up exactly, --parts' what-if against sums done by hand, and
every kind of bad report or bad --parts refused in one line with exit 2. In process."""
import json
import re

import pytest

from patches.cli.plan_partition import main
from patches.partition.memory_model import memory_terms_of, predict_peaks
from patches.partition.plan_lines import plan_line
from patches.partition.report_plan import PlanRequest, plan_of
from patches.partition.report_recompute import recompute_what_if
from tests.helpers.golden import GOLDEN

REPORT = GOLDEN / "fork.report.json"


def run(capsys, *argv):
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_plan_of_a_report_as_it_ran_and_for_another_pp(capsys):
    report = json.loads(REPORT.read_text())
    code, out, err = run(capsys, REPORT)
    assert code == 0 and err == ""
    assert plan_line(report["partition_plan"]) in out.splitlines()  # what the report itself printed
    assert f"use it: --pp-partition-from-profile {REPORT} (Megatron)" in out
    code, out, _ = run(capsys, REPORT, "--pp", 3)
    parts = plan_of(report, PlanRequest(stages=3))["parts"]
    assert code == 0 and len(parts) == 4 and f"with parts {parts} (pp 3)" in out


def rewritten(tmp_path, change):
    report = json.loads(REPORT.read_text())
    return _written(tmp_path, "report.json", change(report))


def drop_totals(report):
    del report["totals"]
    return report


def drop_a_latency(report):
    del report["layers"][3]["bwd_latency_s"]
    return report


def drop_the_layers(report):
    del report["layers"]
    return report


def tie_head_to_stage_0(report):
    """Layer 6, the tied head, as if it had run on stage 0 beside the embedding (layer 0): one node, one stage."""
    report["layers"][6].update(stage=0, node=report["layers"][0]["node"])
    return report


@pytest.mark.parametrize("change, message", [
    (lambda report: [report], "is not the profiler's JSON: a JSON list, not an object"),
    (drop_totals, "is not the profiler's JSON: no totals.throughput_iter_s"),
    (drop_a_latency, "is not the profiler's JSON: layer 3 has no bwd_latency_s"),
    (drop_the_layers, "has no layer table (a PipelineModule's run profiled by this profiler has one)"),
    (tie_head_to_stage_0, "layers 0 and 6 of the profile report ran one tied module on one stage: their times "
                          "cannot be told apart"),
], ids=["not_an_object", "no_totals", "no_latency", "no_layers", "tied_on_one_stage"])
def test_a_bad_report_is_one_line_and_exit_2(tmp_path, capsys, change, message):
    code, out, err = run(capsys, rewritten(tmp_path, change))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_a_missing_report_and_a_bad_pp_are_one_line(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path / "none.json")
    assert code == 2 and err == f"error: the profile report {tmp_path / 'none.json'} cannot be read: No such file " \
                                "or directory\n"
    code, _, err = run(capsys, REPORT, "--pp", 9)
    assert code == 2 and err == "error: --pp 9: the report's 7 layers make 1 to 7 stages\n"


# ---------------------------------------------------------------- --parts: a partition the user names
def small_report():
    """4 layers that ran at pp 2 with parts [0, 2, 4], 4 micro-batches, an iteration of 1.25 s. Every number a
    sum of powers of 2, so the model's arithmetic is exact. Per iteration (forward + backward + recompute):
    layers 0.125, 0.375, 0.25, 0.25 s; the last stage's overhead (its loss) 0.125 s, the first's 0."""
    seconds = [(0.0625, 0.0625, 0.0), (0.125, 0.25, 0.0), (0.125, 0.125, 0.0), (0.0625, 0.125, 0.0625)]
    layers = [{"index": i, "type": "Layer", "stage": 0 if i < 2 else 1, "node": str(i), "fwd_latency_s": fwd,
               "bwd_latency_s": bwd, "recompute_latency_s": recompute}
              for i, (fwd, bwd, recompute) in enumerate(seconds)]
    return {"totals": {"throughput_iter_s": 1.25, "throughput_basis": "unprofiled"},
            "parallelism": {"micro_batches": 4}, "layers": layers,
            "partition_plan": {"current_parts": [0, 2, 4], "stage_overhead_s": [0.0, 0.125]}}


def _written(tmp_path, name, report):
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return path


@pytest.fixture
def small(tmp_path):
    return _written(tmp_path, "small.json", small_report())


# By hand, with m = 4 micro-batches: model(loads) = sum(loads) / 4 + 3 * max(loads) / 4.
# As ran, [0, 2, 4]: loads 0.125 + 0.375 = 0.5 and 0.25 + 0.25 + 0.125 = 0.625; model 1.125 / 4 + 1.875 / 4 = 0.75,
# so 1.25 - 0.75 = 0.5 s of the iteration is what the model leaves out, added to every prediction.
def test_parts_of_the_same_pp_by_hand(small, capsys):
    # [0, 3, 4]: loads 0.125 + 0.375 + 0.25 = 0.75 and 0.25 + 0.125 = 0.375;
    # model 1.125 / 4 + 2.25 / 4 = 0.84375; predicted 0.84375 + 0.5 = 1.34375 s, 1.34375 / 1.25 - 1 = +7.5%.
    code, out, err = run(capsys, small, "--parts", "0,3,4")
    assert code == 0 and err == ""
    assert out == ("4 layers, measured at pp 2, 4 micro-batches; iteration 1.25 s (unprofiled)\n"
                   "stage loads as run:     500 ms, 625 ms\n"
                   "stage loads with parts: 750 ms, 375 ms\n"
                   "partition: stage 1 bounds at 625 ms with parts [0, 2, 4]; with parts [0, 3, 4] (pp 2) stage 0 "
                   "bounds at 750 ms, iteration 1.34 s predicted against 1.25 s measured, +7.5%\n")
    plan = plan_of(small_report(), PlanRequest(parts=[0, 3, 4]))
    assert plan["stage_s"] == [0.75, 0.375] and plan["bound_s"] == 0.75 and plan["predicted_iter_s"] == 1.34375
    assert plan["current_stage_s"] == [0.5, 0.625] and plan["parts"] == [0, 3, 4]


def test_parts_of_another_pp_by_hand(small, capsys):
    # pp 3, [0, 2, 3, 4]: the first stage keeps its overhead (0), the last its 0.125, the middle none;
    # loads 0.5, 0.25, 0.25 + 0.125 = 0.375; model 1.125 / 4 + 1.5 / 4 = 0.65625; predicted 1.15625 s, -7.5%.
    code, out, err = run(capsys, small, "--parts", "0,2,3,4", "--pp", "3")
    assert code == 0 and err == ""
    assert out.splitlines()[2:] == [
        "stage loads with parts: 500 ms, 250 ms, 375 ms",
        "partition: stage 1 bounds at 625 ms with parts [0, 2, 4]; with parts [0, 2, 3, 4] (pp 3) stage 0 bounds at "
        "500 ms, iteration 1.16 s predicted against 1.25 s measured, -7.5%"]
    assert plan_of(small_report(), PlanRequest(parts=[0, 2, 3, 4]))["predicted_iter_s"] == 1.15625
    # pp 1, [0, 4]: one stage with both overheads, 1.0 + 0.125 = 1.125; model 1.125 / 4 + 3.375 / 4 = 1.125;
    # predicted 1.625 s, +30%. (1.125 and 1.625 lie half-way at two decimals: printed half to even, 1.12 and 1.62.)
    code, out, _ = run(capsys, small, "--parts", "0,4")
    assert code == 0 and out.splitlines()[2:] == [
        "stage loads with parts: 1.12 s",
        "partition: stage 1 bounds at 625 ms with parts [0, 2, 4]; with parts [0, 4] (pp 1) stage 0 bounds at "
        "1.12 s, iteration 1.62 s predicted against 1.25 s measured, +30.0%"]
    plan = plan_of(small_report(), PlanRequest(parts=[0, 4]))
    assert plan["stage_s"] == [1.125] and plan["predicted_iter_s"] == 1.625


def test_parts_on_the_golden_report_by_hand(capsys):
    # Each layer's fwd + bwd + recompute from the report's table (ms): 145.59471, 135.44039, 89.23939, 98.67050,
    # 100.51861, 0.82573, 11.80836; stage overheads 38.34766 and 93.01949; every time scaled by the plan's basis,
    # 0.7886156 (the steady iterations 4-6 over the profiled one, which was still warming up). As ran ([0, 3, 7]):
    # stage 0 = (layers 0-2 + 38.34766) x 0.7886156 = 322.24580 bounds, stage 1 = 240.40369. [0, 4, 7]: stage 0 =
    # (layers 0-3 + 38.34766) x 0.7886156 = 400.05889, stage 1 = (layers 4-6 + 93.01949) x 0.7886156 = 162.59060.
    # The sum of the loads is as ran, so the prediction moves by 3/4 of the bound's change:
    # 335.62016 + 0.75 * (400.05889 - 322.24580) = 393.97999 ms, +17.4%.
    code, out, err = run(capsys, REPORT, "--parts", "0,4,7")
    assert code == 0 and err == ""
    assert out.splitlines()[1:] == [
        "stage loads as run:     322.25 ms, 240.4 ms",
        "stage loads with parts: 400.06 ms, 162.59 ms",
        "stage peaks with parts: 533.58 KB, 319.3 KB",  # memory_model's, from the report's terms
        "partition: stage 0 bounds at 322.25 ms with parts [0, 3, 7]; with parts [0, 4, 7] (pp 2) stage 0 bounds at "
        "400.06 ms, iteration 393.98 ms predicted against 335.62 ms measured, +17.4% (over iterations 4, 5, 6, "
        "spread 16.5%)"]
    # The partition that ran, named: the model predicts what was measured.
    code, out, _ = run(capsys, REPORT, "--parts", "0,3,7")
    assert code == 0 and "iteration 335.62 ms predicted against 335.62 ms measured, +0.0%" in out.splitlines()[-1]


FORM = "(give each stage's first layer, then 7, the report's number of layers: 0,...,7)"


@pytest.mark.parametrize("argv, message", [
    (["--parts", "0,x,7"], f"--parts 0,x,7: 'x' is not an integer {FORM}"),
    (["--parts", "0,3.5,7"], f"--parts 0,3.5,7: '3.5' is not an integer {FORM}"),
    (["--parts", "0,,7"], f"--parts 0,,7: '' is not an integer {FORM}"),
    (["--parts", "0,1_0,7"], f"--parts 0,1_0,7: '1_0' is not an integer {FORM}"),
    (["--parts", "7"], f"--parts 7: one stage needs two boundaries, 0 and 7 {FORM}"),
    (["--parts", "1,3,7"], "--parts 1,3,7: the first boundary is 1, it must be 0 (the first layer)"),
    (["--parts", "0,3,6"], "--parts 0,3,6: the last boundary is 6, it must be 7 (the report's number of layers)"),
    (["--parts", "0,3,9"], "--parts 0,3,9: the last boundary is 9, it must be 7 (the report's number of layers)"),
    (["--parts", "0,3,3,7"], "--parts 0,3,3,7: 3 then 3: the boundaries must increase strictly (every stage holds "
                             "at least one layer)"),
    (["--parts", "0,5,3,7"], "--parts 0,5,3,7: 5 then 3: the boundaries must increase strictly (every stage holds "
                             "at least one layer)"),
    (["--parts", "0,3,7", "--pp", "3"], "--parts 0,3,7: 2 stages, but --pp 3"),
], ids=["letter", "decimal", "empty", "underscore", "one_boundary", "first_not_0", "last_short", "last_long",
        "repeated", "decreasing", "pp_disagrees"])
def test_bad_parts_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, REPORT, *argv)
    assert (code, out, err) == (2, "", f"error: {message}\n")


# ---------------------------------------------------------------- under a memory limit
def small_report_with_memory():
    """small_report with memory terms. Each layer's state 100 bytes; kept per micro-batch 100, 1000, 100, 100.
    Stage 0: nothing but its layers, 2 micro-batches in flight; stage 1: base 50, a compute transient of 30, 1 in
    flight; no step transient. So a stage's predicted peak (memory_model.stage_peak), by hand:
      [0, 1, 4]: 100 + 2 x 100 = 300;   50 + 300 + 1200 + 30 = 1580
      [0, 2, 4]: 200 + 2 x 1100 = 2400; 50 + 200 + 200 + 30 = 480   (the partition that ran, the fastest)
      [0, 3, 4]: 300 + 2 x 1200 = 2700; 50 + 100 + 100 + 30 = 280"""
    report = small_report()
    for row, kept in zip(report["layers"], [100, 1000, 100, 100]):
        row.update(state_bytes=100, activation_bytes=kept)
    positions = [(0, 2, 0, 2400), (50, 1, 30, 480)]
    report["stages"] = [{"stage_id": s, "memory": {
        "base_bytes": base, "outside_layers_bytes": 0, "in_flight_micro_batches": in_flight,
        "compute_transient_bytes": transient, "step_transient_bytes": 0, "state_bytes": 200,
        "predicted_peak_bytes": peak}} for s, (base, in_flight, transient, peak) in enumerate(positions)]
    report["bubble"] = {"schedule": "TrainSchedule"}  # DeepSpeed's 1F1B: its in-flight counts for another pp
    return report


@pytest.fixture
def small_memory(tmp_path):
    return _written(tmp_path, "small_memory.json", small_report_with_memory())


def test_a_limit_the_fastest_partition_exceeds_chooses_the_fastest_within_it(small_memory, capsys):
    # [0, 2, 4] peaks at 2400 on stage 0: over 2000. Only [0, 1, 4] fits: loads 0.125 and 0.875 + 0.125 = 1.0;
    # model 1.125 / 4 + 3 x 1.0 / 4 = 1.03125, predicted 1.03125 + 0.5 = 1.53125 s, +22.5%.
    code, out, err = run(capsys, small_memory, "--pp-partition-memory-limit", "2KB")
    assert code == 0 and err == ""
    assert out.splitlines()[1:5] == [
        "stage loads as run:     500 ms, 625 ms",
        "stage loads as planned: 125 ms, 1 s",
        "stage peaks as planned: 300 B, 1.58 KB (limit 2 KB)",
        "partition: stage 1 bounds at 625 ms with parts [0, 2, 4]; with parts [0, 1, 4] (pp 2) the bound is 1 s, "
        "iteration 1.53 s predicted against 1.25 s measured, +22.5%; stage 1 has the least memory headroom, "
        "1.58 KB predicted of 2 KB (flag)"]
    assert "--pp-partition-from-profile " + str(small_memory) + " --pp-partition-memory-limit 2KB (Megatron)" in out
    plan = plan_of(small_report_with_memory(), PlanRequest(limit=2000, limit_source="flag"))
    assert plan["parts"] == [0, 1, 4] and plan["predicted_iter_s"] == 1.53125
    assert plan["predicted_peak_bytes"] == [300, 1580] and plan["memory_fits"] is True
    assert plan["memory_limit_bytes"] == 2000 and plan["memory_excess_bytes"] is None
    # the planner's peaks are memory_model's for the planned parts
    layers, positions = memory_terms_of(small_report_with_memory())
    assert [p.predicted_peak_bytes for p in predict_peaks(layers, positions, [0, 1, 4], 4)] == [300, 1580]
    # a limit the fastest fits leaves it, the stage with the least headroom named
    assert plan_of(small_report_with_memory(), PlanRequest(limit=2400, limit_source="flag"))["parts"] == [0, 2, 4]
    code, out, _ = run(capsys, small_memory, "--memory-limit", "2400")
    assert code == 0 and out.splitlines()[4] == (
        "partition: stage 1 bounds at 625 ms with parts [0, 2, 4], already the best contiguous one for these layers' "
        "measured times within the memory limit; stage 0 has the least memory headroom, 2.4 KB predicted of 2.4 KB "
        "(flag)")


def test_no_partition_within_the_limit_is_one_line_and_exit_2(small_memory, capsys):
    # the closest is [0, 1, 4], peaking at 1580 on stage 1: 580 bytes over 1000
    code, out, err = run(capsys, small_memory, "--pp-partition-memory-limit", "1000")
    assert (code, out) == (2, "")
    assert err == ("error: no partition of these 4 layers into 2 stages keeps every stage's predicted memory peak "
                   "within 1 KB (flag): the closest, parts [0, 1, 4], exceeds it by 580 bytes (580 B) on stage 1, "
                   "1.58 KB predicted\n")
    plan = plan_of(small_report_with_memory(), PlanRequest(limit=1000, limit_source="flag"))
    assert plan["memory_fits"] is False and plan["memory_excess_bytes"] == 580 and plan["parts"] == [0, 1, 4]
    assert plan_line(plan).startswith("partition: stage 1 bounds at 625 ms with parts [0, 2, 4]; no partition of")


def test_parts_print_every_stages_predicted_peak_and_any_excess(small_memory, capsys):
    code, out, err = run(capsys, small_memory, "--parts", "0,3,4")
    assert code == 0 and err == ""
    assert out.splitlines()[3] == "stage peaks with parts: 2.7 KB, 280 B"
    code, out, _ = run(capsys, small_memory, "--parts", "0,3,4", "--pp-partition-memory-limit", "2KB")
    assert code == 0  # a what-if: said, not refused
    assert out.splitlines()[3:] == [
        "stage peaks with parts: 2.7 KB, 280 B (limit 2 KB)",
        "partition: stage 1 bounds at 625 ms with parts [0, 2, 4]; with parts [0, 3, 4] (pp 2) stage 0 bounds at "
        "750 ms, iteration 1.34 s predicted against 1.25 s measured, +7.5%; stage 0's predicted memory peak, 2.7 KB, "
        "exceeds 2 KB (flag) by 700 bytes"]
    # pp 3, [0, 1, 2, 4]: the middle stage takes the first's terms with 1F1B's 2 in flight (min(3 - 1, 4)), the
    # first 3: 100 + 3 x 100 = 400; 100 + 2 x 1000 = 2100; 50 + 200 + 200 + 30 = 480
    code, out, _ = run(capsys, small_memory, "--parts", "0,1,2,4")
    assert code == 0 and out.splitlines()[3] == "stage peaks with parts: 400 B, 2.1 KB, 480 B"


@pytest.mark.parametrize("size, message", [
    ("80XB", "size '80XB' is not a size"),
    ("-1", "size '-1' is negative"),
    ("0", "size '0' is zero"),
])
def test_a_bad_size_is_one_line_and_exit_2(small_memory, capsys, size, message):
    code, out, err = run(capsys, small_memory, "--pp-partition-memory-limit", size)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: --pp-partition-memory-limit {size}: {message}: give a positive number of bytes")
    assert err.count("\n") == 1


def test_a_limit_on_a_report_without_memory_terms_is_one_line_and_exit_2(small, capsys):
    code, out, err = run(capsys, small, "--pp-partition-memory-limit", "80GB")
    assert (code, out) == (2, "")
    assert err == ("error: a memory limit of 80 GB cannot be honoured: the profile report has no memory terms (each "
                   "stage's memory and each layer's state and activation bytes, measured by this profiler on a "
                   "pipeline run)\n")
    code, _, _ = run(capsys, small)  # no limit: planned by time, as before
    assert code == 0


def test_the_limit_a_report_was_planned_under_is_the_default(tmp_path, capsys):
    report = small_report_with_memory()
    report["partition_plan"].update(memory_limit_bytes=2000, memory_limit_source="device")
    code, out, _ = run(capsys, _written(tmp_path, "device.json", report))
    assert code == 0 and "with parts [0, 1, 4] (pp 2)" in out
    assert out.splitlines()[-2].endswith("stage 1 has the least memory headroom, 1.58 KB predicted of 2 KB (device)")


def test_the_golden_report_under_a_limit_keeps_its_basis(capsys):
    # The plan's times scaled by its basis as without a limit; the peaks are memory_model's for the planned parts
    # ([0, 2, 7]: 310,771 and 566,525 bytes; [0, 3, 7], as ran: 422,172 and 432,736). The line says what the times
    # rest on, then the stage with the least headroom.
    code, out, err = run(capsys, REPORT, "--pp-partition-memory-limit", "600KB")
    assert code == 0 and err == ""
    assert out.splitlines()[2:5] == [
        "stage loads as planned: 251.87 ms, 310.78 ms",
        "stage peaks as planned: 310.77 KB, 566.52 KB (limit 600 KB)",
        "partition: stage 0 bounds at 322.25 ms with parts [0, 3, 7]; with parts [0, 2, 7] (pp 2) the bound is "
        "310.78 ms, iteration 327.02 ms predicted against 335.62 ms measured, -2.6% (over iterations 4, 5, 6, "
        "spread 16.5%); the gain is within that spread, so these measurements cannot tell it from noise; stage 1 "
        "has the least memory headroom, 566.52 KB predicted of 600 KB (flag); with each stage's recompute chosen "
        "too: parts [0, 3, 7], --pp-recompute-layers 0,0, iteration 269.54 ms predicted, -19.7%, every stage "
        "within the limit, stage 0 the closest at 530.97 KB"]
    # [0, 2, 7] exceeds 500 KB: the fastest within it is the partition that ran, its loads scaled the same way
    code, out, _ = run(capsys, REPORT, "--pp-partition-memory-limit", "500KB")
    assert code == 0 and out.splitlines()[2:4] == [
        "stage loads as planned: 322.25 ms, 240.4 ms",
        "stage peaks as planned: 422.17 KB, 432.74 KB (limit 500 KB)"]


@pytest.mark.parametrize("limit, counts, change", [("600KB", "0,0", "-19.7%"), ("500KB", "1,1", "-8.6%"),
                                                  ("450KB", "2,2", "+0.0%")])
def test_the_recompute_is_chosen_with_the_partition_under_a_limit(capsys, limit, counts, change):
    """The golden run recomputed both transformer layers of each stage: 600 KB lets every layer keep its activations
    whole, 500 KB one per stage, 450 KB only what ran, whose prediction is then the measured iteration itself."""
    code, out, _ = run(capsys, REPORT, "--pp-partition-memory-limit", limit)
    assert code == 0
    assert f"with each stage's recompute chosen too: parts [0, 3, 7], --pp-recompute-layers {counts}, " in out
    assert re.search(rf"--pp-recompute-layers {counts}, iteration [0-9.]+ ms predicted, {re.escape(change)}, every "
                     "stage within the limit", out)


def test_a_recompute_what_if_is_the_planners_own_prediction(capsys):
    """--recompute predicts a choice the user names with the planner's own model: the plan's choice under 500 KB
    gives the plan's figures, what ran (2,2) gives back the measured iteration; a count list of another length is
    one line, exit 2."""
    report = json.loads(REPORT.read_text())
    chosen = plan_of(report, PlanRequest(limit=500_000, limit_source="flag"))["recompute_plan"]
    assert recompute_what_if(report, chosen["parts"], chosen["recompute_layers"], 500_000) == chosen  # every field
    code, out, _ = run(capsys, REPORT, "--recompute", "1,1", "--pp-partition-memory-limit", "500KB")
    assert code == 0 and chosen["recompute_layers"] == [1, 1]
    assert out.splitlines()[-1] == (
        f"recompute: with parts {chosen['parts']} and --pp-recompute-layers 1,1, iteration 306.83 ms predicted "
        "against 335.62 ms measured, -8.6%; every stage within 500 KB, stage 1 the closest at 464.24 KB")
    code, out, _ = run(capsys, REPORT, "--recompute", "2,2")
    assert code == 0 and out.splitlines()[-1] == ("recompute: with parts [0, 3, 7] and --pp-recompute-layers 2,2, "
                                                  "iteration 335.62 ms predicted against 335.62 ms measured, +0.0%")
    code, out, err = run(capsys, REPORT, "--recompute", "1")
    assert code == 2 and out == "" and err == "error: --recompute 1: 1 counts for 2 stages\n"


def test_a_recompute_the_run_did_not_measure_is_named_as_priced_at_the_forward(tmp_path, capsys):
    """The golden run recomputed layers 1 to 4. Made to say layers 1 and 3 kept their activations whole, a choice
    recomputing the first layer of each stage recomputes those two, whose recompute the run never measured: the
    choice's field names them, and so does its line; a choice recomputing only layers that recomputed names none."""
    report = json.loads(REPORT.read_text())
    for row in report["layers"]:
        if row["index"] in (1, 3):
            row.update(recompute_flops=0, recompute_latency_s=0.0)
    assert recompute_what_if(report, [0, 3, 7], [1, 1])["recompute_priced_from_forward"] == [1, 3]
    assert recompute_what_if(report, [0, 3, 7], [1, 0])["recompute_priced_from_forward"] == [1]
    assert recompute_what_if(report, [0, 2, 7], [0, 2])["recompute_priced_from_forward"] == [3]  # 2 ran, 3 did not
    assert recompute_what_if(report, [0, 3, 7], [0, 0])["recompute_priced_from_forward"] == []
    code, out, _ = run(capsys, _written(tmp_path, "kept.json", report), "--recompute", "1,1")
    assert code == 0 and out.splitlines()[-1].endswith(
        "; layers 1 and 3 kept their activations whole in this run: their recompute is priced at that forward, not "
        "measured (a profile of a run that recomputes them measures it)")
    # the golden report as it ran: every layer a choice recomputes recomputed there
    assert recompute_what_if(json.loads(REPORT.read_text()), [0, 3, 7], [2, 2])["recompute_priced_from_forward"] == []
