"""Reports of fixed runs, kept as the profiler printed and wrote them (tests/data/golden/), and the comparison
that holds a new run against them: everything equal except what the clock measured.

Counts (FLOPs, params, calls, instruction counts), the layout, the tree, the notes and every sentence are
compared exactly. What a clock decides is replaced by a placeholder on both sides before comparing:
seconds and the rates, shares and ratios made from them, and what the slowest stage or replica decides
(the bounding stage, the slowest replica, the top modules by latency, the column widths of a table).
So is what the allocator's levels decide in the memory figures (every byte alive in the process counts there);
what the garbage collector did (its pauses, per stage, and their line) is left out;
the state's bytes and the activations the layers save are compared exactly.
"""
import json
import re
from pathlib import Path
from typing import Any

from patches.profiler.printed_stages import GC_LABEL
from patches.profiler.printer import CLOSING, HEADER

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"

MEASURED = "<measured>"

# Floats in the report that are not measured: ratios of counts, the given peak, the 1F1B ideal.
EXACT_FLOATS = {"measured_over_analytic", "peak_tflops", "ideal_fraction", "log_line_flops"}
# Values that a clock decides although they are not floats.
# (The partition plan's parts, and the stage that bounds the partition that ran, follow the layers' times.)
DECIDED_BY_TIME = {"bounding_stage", "slowest_dp_rank", "slowest_ranks", "log_line_note", "parts",
                   "current_bounding_stage", "warming_up_note", "gain_within_spread"}
# Decided by the machine the run had: whether its ranks shared too few CPUs, and how long they waited for one (the
# plan's basis, and its line).
DECIDED_BY_THE_MACHINE = {"shared_cpus"}
# What the garbage collector did (when it runs follows every allocation in the process), and its line: left out of
# the comparison, as the golden runs, from before it was measured, have neither (tests/test_gc_pauses.py holds both).
DECIDED_BY_THE_COLLECTOR = {"gc"}
# Measured since the golden runs were recorded: null there (the rebuilt report says so), a figure in a new run; left
# out of the comparison of a new run (tests/test_memory_measurement.py and the allocator test hold it).
MEASURED_SINCE_THE_GOLDEN_RUNS = {"optimizer_step_transient_bytes"}
# Memory figures read off the allocator's levels, and the tp rank they pick.
DECIDED_BY_THE_ALLOCATOR = {"start_bytes", "end_bytes", "base_bytes", "kept_bytes_per_micro_batch",
                            "outside_layers_bytes", "compute_transient_bytes", "step_transient_bytes",
                            "compute_peak_bytes", "step_peak_bytes", "predicted_peak_bytes", "measured_peak_bytes",
                            "measured_peak_instruction", "unseen_free_bytes", "global_rank"}

# Summary lines whose whole value is measured (a rate, a ratio, a sentence quoting them).
_MEASURED_LINES = re.compile(r"^(perturbation = |counting iteration / unprofiled|samples/second|tokens/second|"
                             r"training log line's TFLOPs|why they differ|baseline$|\s*partition$|\s+(kept per "
                             r"micro-batch in flight|base \(alive|transients|predicted peak|measured peak))")
_MEMORY_RANK = re.compile(r"^(stage \d+ \(rank )\d+(, iteration)")
_TOP_BY_TIME = re.compile(r"^(\s+(?:fwd|bwd|recompute) latency\s+- ).*$")
_DURATION = re.compile(r"\b\d+(?:\.\d+)? (?:s|ms|us)\b")
_RATE = re.compile(r"\b\d+(?:\.\d+)? ?[KMGTPE]?FLOPS\b")
_PERCENT = re.compile(r"[+-]?\d+(?:\.\d+)?%(?! (?:Params|flops))")
_POINTS = re.compile(r"[+-]\d+(?:\.\d+)? pts")
_BOUNDING_MARK = re.compile(r"^(\s+\d+) \*")
_BOUNDING_STAGE = re.compile(r"((?:ForwardPass|BackwardPass|OptimizerStep) of stage|waits for stage|\* stage) \d+")


def report_block(output: str) -> str:
    """The printed report in a run's output: from its header line to its closing line."""
    lines = output.splitlines()
    start = lines.index(HEADER)
    end = lines.index(CLOSING, start)
    return "\n".join(lines[start:end + 1])


def normalise_text(text: str) -> str:
    out = []
    for line in text.splitlines():
        if GC_LABEL in line:
            continue
        label, colon, value = line.partition(":")
        if colon and _MEASURED_LINES.match(label):
            line = f"{label}: {MEASURED}"
        line = _TOP_BY_TIME.sub(r"\1" + MEASURED, line)
        for pattern in (_DURATION, _RATE, _PERCENT, _POINTS):
            line = pattern.sub(MEASURED, line)
        line = _BOUNDING_MARK.sub(r"\1", line)
        line = _MEMORY_RANK.sub(r"\1" + MEASURED + r"\2", line)
        line = _BOUNDING_STAGE.sub(r"\1 " + MEASURED, line)
        out.append(" ".join(line.split()))  # a table's column widths follow its measured cells
    return "\n".join(out)


def normalise_report(value: Any, key: str = "") -> Any:
    if key in DECIDED_BY_TIME or key in DECIDED_BY_THE_MACHINE or (key in DECIDED_BY_THE_ALLOCATOR and
                                                                   value is not None):
        return MEASURED
    if isinstance(value, dict):
        return {k: normalise_report(v, k) for k, v in value.items()
                if k not in DECIDED_BY_THE_COLLECTOR and k not in MEASURED_SINCE_THE_GOLDEN_RUNS}
    if isinstance(value, list):
        return [normalise_report(v, key) for v in value]
    if isinstance(value, float) and key not in EXACT_FLOATS:
        return MEASURED
    return value


def golden_report(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.report.json").read_text())


def golden_text(name: str) -> str:
    return (GOLDEN / f"{name}.txt").read_text()


def assert_report_as_golden(name: str, report: dict) -> None:
    assert normalise_report(report) == normalise_report(golden_report(name))


def assert_text_as_golden(name: str, output: str) -> None:
    """output: a run's whole output (or the report's text alone)."""
    new, old = normalise_text(report_block(output)).splitlines(), normalise_text(golden_text(name)).splitlines()
    assert new == old
