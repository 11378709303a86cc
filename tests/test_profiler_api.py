"""DeepSpeed's FlopsProfiler API over a measurement and a report source (patches/profiler/api.py, sources.py), in
one process: what the getters show, how a report is labelled, what reset_profile clears, and how the schedule
lets go of a counting pass whose profiled iteration never came."""
import gc
import weakref

from patches.profiler.api import ProfilerAPI
from patches.profiler.attachment import attached, attachment_of
from patches.profiler.context import RunDescription
from patches.profiler.local_sources import LocalReport
from patches.profiler.measurement import CountingPass, StageMeasurement
from patches.profiler.one_step import ProfileSchedule
from patches.profiler.pipeline_profiler import PipelineFlopsProfiler
from patches.profiler.report import build_report
from tests.test_profiler_report import make_context, rank_entries


def held_profiler():
    """A profiler whose own source measured nothing, holding a built report (as after the config section)."""
    measurement = StageMeasurement(engine=None)
    profiler = ProfilerAPI(measurement, LocalReport(measurement))
    report = build_report(rank_entries(), make_context())
    profiler.hold(report)
    return profiler, report


def test_a_held_report_answers_the_getters_and_its_label_sticks():
    profiler, report = held_profiler()
    totals = report["totals"]
    assert (profiler.flops, profiler.macs, profiler.params) == (totals["fwd_flops"], totals["fwd_flops"] // 2,
                                                                totals["params"])
    assert profiler.get_report() is report and report["step"] == 7
    relabelled = profiler.get_report(profile_step=9)
    assert relabelled["step"] == 9 and relabelled["totals"] is totals and report["step"] == 7  # a copy, not an edit
    assert profiler.get_report()["step"] == 9  # DeepSpeed's meaning: profile_step labels the report from then on
    assert profiler.get_report(profile_step=7) is report


def test_reset_profile_lets_go_of_a_held_report():
    profiler, _ = held_profiler()
    profiler.reset_profile()
    assert (profiler.get_total_flops(), profiler.get_total_params(), profiler.get_total_duration()) == (0, 0, 0.0)


def test_pipeline_profiler_takes_the_run_whole_or_by_its_fields():
    by_fields = PipelineFlopsProfiler(None, seq_length=16, peak_tflops=0.5)
    assert by_fields._own_source.run == RunDescription(seq_length=16, peak_tflops=0.5)
    whole = RunDescription(seq_length=8)
    assert PipelineFlopsProfiler(None, whole)._own_source.run is whole
    assert PipelineFlopsProfiler(None)._own_source.run is None  # the Megatron of the process says, at report time


def test_the_schedule_drops_a_counting_pass_whose_profiled_iteration_did_not_come():
    schedule = ProfileSchedule(5)
    schedule._counted = CountingPass(4, module_profiler=None)  # counted in 4; 5 went elsewhere (user code)
    assert schedule.run(None, None, 6, lambda: "loss") == ("loss", None)
    assert schedule._counted is None


def test_an_engine_attachment_goes_with_its_engine_and_its_ordinal_is_never_reused():
    class Engine:  # what the attachment reads of an engine: its __dict__, and its class
        pass

    engine = Engine()
    assert attached(engine) is None
    ordinal, gone = attachment_of(engine).ordinal, weakref.ref(engine)
    assert attached(engine) is attachment_of(engine) and not attachment_of(engine).runs_a_schedule
    del engine
    gc.collect()
    assert gone() is None
    assert attachment_of(Engine()).ordinal == ordinal + 1  # an ordinal is never reused
