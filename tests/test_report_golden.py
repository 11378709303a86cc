"""The report of a fixed run, rebuilt from what its ranks measured, is the report that run printed and wrote.

tests/data/golden/NAME.build_inputs.json holds what the report builder of a real launch received (replica 0's
rank entries, every rank's sample, and rank 0's ReportContext: the run's description and the iteration
times); NAME.report.json and NAME.txt are the JSON and the text that launch wrote and printed. Built again
here from the same measurements, every number must come out bitwise the same, rates included: a change to
how the report is put together may not change a figure. (The launch tests hold new runs against the same files, times
aside: tests/helpers/golden.py.)
"""
import json

import pytest

from patches.profiler.context import IterationTiming, ReportContext, RunDescription
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from patches.profiler.stragglers import RankSample
from tests.helpers.golden import GOLDEN, golden_report, golden_text, report_block

# fork: our GPT, pp 2 x tp 2, checkpointed, iteration 3 profiled (--profile-flops-step; an unprofiled baseline);
# section: 3 stages and a tied layer, DeepSpeed's flops_profiler section (DeepSpeed's numbering: batch 0 the baseline)
PRINTED_WITH = {"fork": {}, "section": {"module_depth": -1, "top_modules": 2, "detailed": True}}


def recorded_context(recorded):
    """The ReportContext the recorded run's rank 0 built (dataclasses.asdict of it)."""
    run = RunDescription(**recorded["run"])
    timing = IterationTiming(**recorded["timing"]) if recorded["timing"] is not None else None
    return ReportContext(**dict(recorded, run=run, timing=timing))


def rebuilt(name):
    inputs = json.loads((GOLDEN / f"{name}.build_inputs.json").read_text())
    samples = [RankSample(**sample) for sample in inputs["samples"]]
    return build_report(inputs["entries"], recorded_context(inputs["context"]), samples)


@pytest.mark.parametrize("name", sorted(PRINTED_WITH))
def test_rebuilt_report_is_the_written_one(name):
    report = rebuilt(name)
    if name == "fork":
        assert report == golden_report(name)
    assert report_block(format_report(report, **PRINTED_WITH[name])) == report_block(golden_text(name))
