"""The report's memory (patches/profiler/memory_report.py, report.build_report, the printer, the schema), from the
golden fork run's real entries (tests/data/golden/fork.build_inputs.json: pp 2 x tp 2, checkpointed)."""
import copy
import json

import jsonschema
import pytest

from patches.profiler.files import validate_report
from patches.profiler.memory_report import per_gpu, stage_memory
from patches.profiler.notes import FIRST_STEP_PEAKS
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from patches.profiler.stragglers import RankSample
from tests.helpers.golden import GOLDEN
from tests.test_report_golden import recorded_context


@pytest.fixture
def inputs():
    return json.loads((GOLDEN / "fork.build_inputs.json").read_text())


def _report(inputs):
    return build_report(inputs["entries"], recorded_context(inputs["context"]),
                        [RankSample(**sample) for sample in inputs["samples"]])


def test_each_stage_shows_its_tp_rank_with_the_largest_predicted_peak(inputs):
    report = _report(inputs)
    validate_report(report)
    for stage in report["stages"]:
        entries = [e for e in inputs["entries"] if e["stage_id"] == stage["stage_id"]]
        candidates = [stage_memory(e, 2) for e in entries]
        assert stage["memory"] == per_gpu(entries, 3)[0]
        assert stage["memory"]["predicted_peak_bytes"] == max(c["predicted_peak_bytes"] for c in candidates)
        memory = stage["memory"]
        assert memory["iteration"] == 2  # where the FLOPs were counted
        assert memory["predicted_peak_bytes"] == memory["base_bytes"] + memory["state_bytes"] + max(
            memory["in_flight_micro_batches"] * memory["kept_bytes_per_micro_batch"]
            + memory["compute_transient_bytes"], memory["step_transient_bytes"])
        assert memory["kept_bytes_per_micro_batch"] == memory["layer_activation_bytes"] + memory["outside_layers_bytes"]
        rows = [row for row in report["layers"] if row["stage"] == stage["stage_id"]]
        assert sum(row["state_bytes"] for row in rows) == memory["state_bytes"]
        assert sum(row["activation_bytes"] for row in rows) == memory["layer_activation_bytes"]


def test_a_stage_whose_allocator_was_not_read_shows_its_state_and_layers(inputs):
    for entry in inputs["entries"]:
        if entry["stage_id"] == 1:
            entry["memory"] = dict(entry["memory"], allocator=None, basis=None,
                                   not_read="torch.profiler was already running in this process (one profiler at a "
                                            "time)")
    report = _report(inputs)
    validate_report(report)
    memory = report["stages"][1]["memory"]
    assert memory["predicted_peak_bytes"] is None and memory["measured_peak_bytes"] is None
    assert memory["state_bytes"] == memory["param_bytes"] + memory["grad_bytes"] + memory["optimizer_bytes"] > 0
    assert all(row["activation_bytes"] is not None for row in report["layers"])
    assert ("n/a: the allocator was not read (torch.profiler was already running in this process (one profiler at a "
            "time))") in format_report(report)


def test_a_first_step_measured_says_its_peaks_part(inputs):
    # stage 0's optimizer made its state in the measured step (a run profiled at 2 measures iteration 1): the
    # printout says why its measured peak stands under the predicted one; stage 1's, whose state was there, does not
    for entry in inputs["entries"]:
        if entry["stage_id"] == 0:
            entry["memory"] = dict(entry["memory"], optimizer_created_bytes=1234)
    text = format_report(_report(inputs))
    stage0, stage1 = text.split("stage 0 (rank ")[1].split("stage 1 (rank ")
    assert "optimizer state created in its step (a first step):" in stage0 and FIRST_STEP_PEAKS in stage0
    assert FIRST_STEP_PEAKS not in stage1


def test_entries_without_memory_give_nulls(inputs):
    for entry in inputs["entries"]:
        entry.pop("memory")
    report = _report(inputs)
    validate_report(report)
    assert [stage["memory"] for stage in report["stages"]] == [None, None]
    assert {(row["activation_bytes"], row["state_bytes"]) for row in report["layers"]} == {(None, None)}
    assert "Memory per GPU" not in format_report(report) and "kept/micro-batch" not in format_report(report)


def test_the_schema_holds_the_memory_fields(inputs):
    report = _report(inputs)
    broken = copy.deepcopy(report)
    del broken["stages"][0]["memory"]["predicted_peak_bytes"]
    with pytest.raises(jsonschema.ValidationError):
        validate_report(broken)
    broken = copy.deepcopy(report)
    broken["layers"][0]["state_bytes"] = -1
    with pytest.raises(jsonschema.ValidationError):
        validate_report(broken)


def test_the_reports_plan_under_a_memory_limit(inputs):
    """A run given --pp-partition-memory-limit (or on a device that reports its memory) plans under it. The fork
    run's fastest partition, [0, 2, 7], peaks at 310,771 and 566,525 bytes; as it ran, [0, 3, 7], at 422,172 and
    432,736, the least of any partition of its layers."""
    inputs["context"].update(memory_limit_bytes=600_000, memory_limit_source="flag")
    report = _report(inputs)
    validate_report(report)
    plan = report["partition_plan"]
    assert plan["parts"] == [0, 2, 7] and plan["predicted_peak_bytes"] == [310771, 566525]
    assert (plan["memory_limit_bytes"], plan["memory_limit_source"], plan["memory_fits"]) == (600_000, "flag", True)
    assert ("stage 1 has the least memory headroom, 566.52 KB predicted of 600 KB (flag)"
            in format_report(report))
    inputs["context"].update(memory_limit_bytes=500_000)  # [0, 2, 7] exceeds it: the fastest that fits
    plan = _report(inputs)["partition_plan"]
    assert plan["parts"] == [0, 3, 7] and plan["predicted_peak_bytes"] == [422172, 432736] and plan["memory_fits"]
    inputs["context"].update(memory_limit_bytes=420_000, memory_limit_source="device")
    report = _report(inputs)
    validate_report(report)
    plan = report["partition_plan"]
    assert plan["memory_fits"] is False and plan["memory_excess_bytes"] == 432736 - 420_000
    assert ("no partition of these 7 layers into 2 stages keeps every stage's predicted memory peak within 420 KB "
            "(device): the closest, parts [0, 3, 7], exceeds it by 12,736 bytes (12.74 KB) on stage 1, 432.74 KB "
            "predicted") in format_report(report)


def test_a_limit_without_memory_terms_is_said_not_honoured(inputs):
    for entry in inputs["entries"]:
        entry.pop("memory")
    inputs["context"].update(memory_limit_bytes=600_000, memory_limit_source="flag")
    report = _report(inputs)
    validate_report(report)
    assert report["partition_plan"]["predicted_peak_bytes"] is None
    assert "the memory limit of 600 KB (flag) is not honoured: the report has no memory terms" in format_report(report)
    inputs["context"].update(memory_limit_source="device")  # the device's: a default, planned by time as before
    plan = _report(inputs)["partition_plan"]
    assert plan["memory_limit_bytes"] is None and plan["memory_limit_source"] is None
