"""megatron-plan-partition (patches/cli/plan_partition.py) on a real report (the golden fork run's: our GPT at
pp 2 x tp 2), and every kind of bad report refused in one line with exit 2. In process."""
import json

import pytest

from patches.cli.plan_partition import main
from patches.partition.planner import plan_of
from patches.profiler.printer import plan_line
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
    parts = plan_of(report, 3)["parts"]
    assert code == 0 and len(parts) == 4 and f"with parts {parts} (pp 3)" in out


def rewritten(tmp_path, change):
    report = json.loads(REPORT.read_text())
    report = change(report)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


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
