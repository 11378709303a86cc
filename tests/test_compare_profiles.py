"""tools/compare_profiles.py on real reports: a report against itself, against another configuration of
the same model (pp=2 x tp=1 without checkpointing, under ZeRO stage 1: the run test_partition_fork.py resumes),
and against a report of another model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from patches.profiler.files import write_json
from patches.profiler.module_profiler import ModuleProfiler
from patches.profiler.report import build_report
from tests.helpers.contexts import report_context
from tests.helpers.launch import load_tool
from tests.helpers.profiled_runs import profiled_run

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "compare_profiles.py"




def compare(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return profiled_run(tmp_path_factory, "pp2_tp2_checkpointed"), profiled_run(tmp_path_factory, "pp2_tp1_zero1")


def _is_sorted_by_change(rows):
    sizes = [(abs(r["change"]) if r["change"] is not None else float("inf"), abs(r["delta"])) for r in rows]
    return sizes == sorted(sizes, reverse=True)


@pytest.mark.launch
def test_a_report_against_itself_has_zero_deltas(runs, tmp_path):
    run, _ = runs
    rows_file = tmp_path / "rows.json"
    process = compare(run.report_path, run.report_path, "--json", rows_file)
    assert process.returncode == 0, process.stderr
    assert "Identical: every compared value is equal." in process.stdout
    rows = json.loads(rows_file.read_text())
    assert len(rows["totals"]) == 13  # MFU included: the run gave --peak-tflops
    assert len(rows["stages"]) == 2 * 14  # peak memory is null on CPU; the memory's 4 rows are there
    assert len(rows["modules"]) == 6 * 43  # 43 modules in the whole-model tree
    for row in rows["totals"] + rows["stages"] + rows["modules"]:
        assert row["delta"] == 0 and row["change"] == 0 and row["a"] == row["b"]


@pytest.mark.launch
def test_another_configuration_gives_the_true_differences(runs, tmp_path):
    """tp 2 with checkpointing vs tp 1 without: the same flops but no recompute, module by module."""
    (a_run, b_run), tool = runs, load_tool("compare_profiles")
    a, b = a_run.report, b_run.report
    comparison = tool.compare_reports(a, b)
    totals = {r["metric"]: r for r in comparison["totals"]}
    assert [totals[k]["delta"] for k in ("params", "fwd_flops", "bwd_flops")] == [0, 0, 0]
    assert totals["recompute_flops"]["delta"] == -a["totals"]["recompute_flops"] < 0
    for key, row in totals.items():
        assert row["delta"] == b["totals"][key] - a["totals"][key]
    nodes_a, nodes_b = tool.modules_by_path(a["model_tree"]), tool.modules_by_path(b["model_tree"])
    layers = [path for path in nodes_a if path.isdigit() and nodes_a[path]["type"] == "ParallelTransformerLayerPipe"]
    assert len(layers) == 4
    by_key = {(r["scope"], r["metric"]): r for r in comparison["modules"]}
    for path in layers:  # checkpointing re-ran exactly each layer's forward
        assert by_key[(path, "recompute_flops")]["delta"] == -nodes_a[path]["fwd_flops"]
    for (scope, metric), row in by_key.items():
        path = "" if scope == a["model_tree"]["type"] else scope
        assert row["delta"] == nodes_b[path][metric] - nodes_a[path][metric]
        if metric in ("fwd_flops", "bwd_flops"):
            assert row["delta"] == 0
    stages = {(r["scope"], r["metric"]): r for r in comparison["stages"]}
    for stage_a, stage_b in zip(a["stages"], b["stages"]):
        scope = f"stage {stage_a['stage_id']}"
        for metric in ("fwd_flops", "bwd_flops", "fwd_latency_s", "comm_s", "train_batch_latency_s"):
            assert stages[(scope, metric)]["delta"] == stage_b[metric] - stage_a[metric]
        assert stages[(scope, "recompute_flops")]["change"] == -1.0
    assert _is_sorted_by_change(comparison["stages"]) and _is_sorted_by_change(comparison["modules"])
    process = compare(a_run.report_path, b_run.report_path, "--top", "5")
    assert process.returncode == 0, process.stderr
    assert "Identical" not in process.stdout
    heading = "Modules (largest changes first; 5 of 258 rows, --top 0 shows all):\n"
    module_lines = process.stdout.split(heading)[1].splitlines()
    assert len(module_lines) == 6  # header and the 5 largest changes, in order
    for line, row in zip(module_lines[1:], comparison["modules"]):
        assert line.split()[:2] == [row["scope"], row["label"].split()[0]]


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def tiny_model_report(path):
    """A real report of another model: one rank, one stage, no pipeline."""
    model = TinyMLP()
    profiler = ModuleProfiler(model)
    profiler.start()
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    profiler.stop()
    entry = {"global_rank": 0, "stage_id": 0, "tp_rank": 0, "dp_rank": 0, "modules": profiler.tree(),
             "instructions": {}, "train_batch_latency_s": 0.01, "peak_memory_bytes": None}
    write_json(build_report([entry], report_context(1, 1, 1, 1, 1, 2)), str(path))
    return path


@pytest.mark.launch
def test_different_models_are_refused_in_one_line(runs, tmp_path):
    run, _ = runs
    other = tiny_model_report(tmp_path / "tiny.json")
    process = compare(run.report_path, other)
    assert process.returncode == 2 and process.stdout == ""
    assert process.stderr == "error: the reports profile different models: 57536 params in A, 76 in B\n"
    renamed = run.report
    renamed["model_tree"]["children"][0]["name"] = "embedding"
    renamed_path = tmp_path / "renamed.json"
    renamed_path.write_text(json.dumps(renamed))
    process = compare(run.report_path, renamed_path)
    assert process.returncode == 2
    assert process.stderr.count("\n") == 1
    assert "the reports profile different models: module 'embedding' is only in B" in process.stderr
    not_a_report = tmp_path / "other.json"
    not_a_report.write_text('{"traceEvents": []}')
    process = compare(not_a_report, run.report_path)
    assert process.returncode == 2
    expected = f"error: {not_a_report} is not a FLOPs profile report (schema_version 1 or 2 with a model_tree)\n"
    assert process.stderr == expected
