"""DeepSpeed's FlopsProfiler methods, over one StageMeasurement and one report source (sources.py).

Both profilers a user meets are this class composed with a source: PipelineFlopsProfiler with the
collective GatheredReports; DeepSpeed's own FlopsProfiler(model[0]) on a PipelineEngine, and
engine.flops_profiler, with the store's PublishedReports (engine.flops_profiler of a plain engine:
LocalReport). Whether a call is collective is the source's type.
"""
import functools
import sys
from typing import Callable, Iterable, Optional, Union

from deepspeed.runtime.engine import DeepSpeedEngine

from patches.formats.units import duration_to_string, number_to_string, params_to_string
from patches.profiler.files import write_json, write_trace
from patches.profiler.layout import EngineLayout
from patches.profiler.local_sources import HeldReport
from patches.profiler.measurement import StageMeasurement
from patches.profiler.sources import (
    MeasuringSource,
    ProfileIncomplete,
    ReportSource,
    print_report,
    warned_not_built,
)


class ProfilerAPI:
    def __init__(self, measurement: StageMeasurement, source: MeasuringSource):
        """source: the report source (sources.py) this profiler measures and reports through."""
        self.measurement = measurement
        self._own_source = source
        self._source: ReportSource = source  # the own source, or a report held (hold) until the next start
        # DeepSpeed's FlopsProfiler attributes, set when a report is built (print_model_profile, get_report).
        self.flops = self.macs = self.params = None

    @property
    def engine(self) -> DeepSpeedEngine:
        return self.measurement.engine

    @property
    def layout(self) -> EngineLayout:
        return self.measurement.layout

    @property
    def started(self) -> bool:
        return self.measurement.started

    # ------------------------------------------------------------------ measuring
    def start_profile(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        """Install every hook and timer (afresh, if profiled before). Local: no rank waits for another.

        ignore_list: module types left out of the profile, as in DeepSpeed (their flops, latencies and
        params are not in the report, nor in their ancestors' totals)."""
        if self.started:
            return
        self._source = self._own_source
        self._own_source.start(ignore_list)

    def stop_profile(self) -> None:
        self.measurement.stop()

    def end_profile(self) -> None:
        """Remove every hook, wrapper and swapped function: the engine runs as if never profiled."""
        self.measurement.detach()

    def reset_profile(self) -> None:
        """Zero the counts and timings gathered so far (a held report goes too); profiling, if started, goes on."""
        self.measurement.reset()
        self._source = self._own_source
        self._source.forget()

    def hold(self, report: dict) -> None:
        """Show `report`, built elsewhere (the config section's), until the next start_profile."""
        self._source = HeldReport(report)
        self._set_attributes(report)

    # ------------------------------------------------------------------ the report
    def get_report(self, profile_step: Optional[int] = None) -> dict:
        """The schema's dict. Collective where the source is (PipelineFlopsProfiler: every rank calls it)."""
        report = self._source.report(profile_step)
        self._set_attributes(report)
        return report

    def _set_attributes(self, report: dict) -> None:
        """DeepSpeed's attributes, from the report just built."""
        flops, self.params, _ = _report_totals(report)
        self.flops, self.macs = flops, _macs(flops)

    # DeepSpeed's meaning: forward FLOPs, MACs and forward duration of the profiled model, and its params.
    # Once a report is built (after the profiled step), they are the whole-model values, the same on every
    # rank: one replica, every micro-batch of the step. Before that, this rank's own counts so far. They never
    # gather, so one rank may call them alone.
    def _totals(self):
        report = self._source.ready()
        return _report_totals(report) if report is not None else self.measurement.local_totals()

    def get_total_flops(self, as_string: bool = False) -> Union[int, str]:
        flops = self._totals()[0]
        return _with_unit(number_to_string(flops), "FLOPS") if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> Union[int, str]:
        macs = _macs(self._totals()[0])
        return _with_unit(number_to_string(macs), "MACs") if as_string else macs

    def get_total_params(self, as_string: bool = False) -> Union[int, str]:
        params = self._totals()[1]
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> Union[float, str]:
        duration = self._totals()[2]
        return duration_to_string(duration) if as_string else duration

    # ------------------------------------------------------------------ printing and writing
    def _report_or_say_why(self, get: Callable[[], dict]) -> Optional[dict]:
        """get(): the report (collective where the source is); a profile not complete, or one a rank could not
        build, is one line instead of it, and training goes on."""
        try:
            report = get()
        except ProfileIncomplete as missing:
            print(str(missing), file=sys.stderr, flush=True)
            return None
        except Exception as error:  # a gathered report one rank could not build: every rank is here, alike
            if not warned_not_built(error, "no report"):
                raise
            return None
        self._set_attributes(report)
        return report

    def print_model_profile(self, profile_step: Optional[int] = None, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: Optional[str] = None) -> None:
        """The whole-model report, printed (or written to output_file) by the rank the source names."""
        self._report_or_say_why(lambda: print_report(self._source, profile_step, output_file,
                                                     module_depth=module_depth, top_modules=top_modules,
                                                     detailed=detailed))

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """The top module types per depth of the whole model (the report's Aggregated Profile)."""
        self._report_or_say_why(lambda: print_report(self._source, None, module_depth=module_depth,
                                                     top_modules=top_modules, aggregated_only=True))

    def write_json(self, path: str, profile_step: Optional[int] = None) -> None:
        """The schema's JSON, written to path by the rank the source names."""
        report = self.get_report(profile_step)
        self._source.write(functools.partial(write_json, report, path), path)

    def write_trace(self, path: str, profile_step: Optional[int] = None) -> None:
        """The Chrome trace (Perfetto, chrome://tracing) of the reported replica: a process per stage, a track
        per tensor rank (trace.py)."""
        report = self.get_report(profile_step)
        trace = self._source.trace(report["step"])
        self._source.write(functools.partial(write_trace, trace, path), path)

    def is_expert_tensor_parallelism_enabled(self) -> bool:
        """DeepSpeed's meaning: a MoE layer of the model shards its experts over tensor ranks."""
        from deepspeed.moe.layer import MoE

        return any(getattr(m, "enable_expert_tensor_parallelism", False)
                   for m in self.engine.module.modules() if isinstance(m, MoE))


def _report_totals(report: dict):
    """(forward FLOPs, params, forward latency) of a built report: the whole model's."""
    totals = report["totals"]
    return totals["fwd_flops"], totals["params"], totals["fwd_latency_s"]


def _macs(flops: int) -> int:
    """Matrix work is 2 FLOPs per multiply-accumulate, so MACs are half the forward FLOPs."""
    return flops // 2


def _with_unit(text, unit):
    return f"{text}{unit}" if text[-1].isalpha() else f"{text} {unit}"
