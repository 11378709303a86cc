"""Make DeepSpeed's `flops_profiler` config section give our gathered report (DeepSpeed 0.19.x).

What 0.19.8 does: the section starts DeepSpeed's FlopsProfiler on
global rank 0 only, prints it only from DeepSpeedEngine.step(), which PipelineEngine never calls,
and, by forcing the wall-clock timers on, crashes every pipeline stage but the last ("bwd_microstep
timer has already been started": _exec_backward_pass starts the backward timers, then the engine's
own backward prologue starts them again).

What these patches change:
1. The engine's own FlopsProfiler is never started (flops_profiler_enabled() is False; the start-up
   log line still says whether the section is on); the section is read directly from the engine's
   config instead, and engine.flops_profiler is a UserCodeFlopsProfiler (DeepSpeed's FlopsProfiler API,
   measured numbers, safe on any subset of ranks) on every rank.
2. PipelineEngine.train_batch goes through the engine's one profile schedule (profiler/one_step.py, as
   --profile-flops-step does), in DeepSpeed's numbering: the batch that starts when global_steps ==
   profile_step is profiled on every rank of every stage, the batch before it counts its FLOPs. One
   report is gathered at a point every rank passes (inside that train_batch) and printed from global
   rank 0, honouring module_depth, top_modules, detailed and output_file (an output_file that cannot be
   written is one warning line on rank 0; training goes on on every rank); engine.flops_profiler then
   holds it, for the getters on any rank.
3. A plain DeepSpeedEngine (no pipeline) gets the same report: profiling starts at the first forward of
   profile_step on every rank and ends when step() closes that step (its FLOPs counted in it).
(The wall-clock timer fixes are pipeline_timers.py and section_timers.py.)
"""
import functools
import weakref

import deepspeed.runtime.engine as ds_engine
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from patches.errors import PatchConfigError
from patches.profiler.context import describe_run
from patches.profiler.measurement import ACTIVE, StageMeasurement
from patches.profiler.one_step import ProfileSchedule, report_and_detach
from patches.profiler.printer import format_report
from patches.profiler.sources import GatheredReports, ReportWriteError, warn_on_rank_0
from patches.profiler.user_code_profiler import UserCodeFlopsProfiler

WHAT_IT_FIXES = "the flops_profiler section (and engine.flops_profiler)"

_state = {"flag_step": None}


def yield_to_flag(profile_step):
    """--profile-flops-step was given: it wins over the config section (the caller logs that)."""
    _state["flag_step"] = profile_step


def requires():
    """What these patches and the profiler they start use of DeepSpeed (private names included)."""
    return [(DeepSpeedEngine, name) for name in ("flops_profiler_enabled", "flops_profiler_profile_step",
                                                 "autotuning_enabled", "wall_clock_breakdown", "forward", "step")] + \
        [(PipelineEngine, "train_batch"), (PipelineEngine, "_INSTRUCTION_MAP"), (PipelineEngine, "_exec_schedule"),
         (ds_engine, "EngineTimers"), (ds_engine, "log_dist")]


def install():
    DeepSpeedEngine.__init__ = _with_flops_profiler(DeepSpeedEngine.__init__)
    ds_engine.log_dist = _true_start_up_line(ds_engine.log_dist)
    DeepSpeedEngine.flops_profiler_enabled = _engine_profiler_never_enabled
    DeepSpeedEngine.forward = _profiling_forward(DeepSpeedEngine.forward)
    PipelineEngine.train_batch = _profiling_train_batch(PipelineEngine.train_batch)


def wants_profiler(engine):
    """DeepSpeed builds its FlopsProfiler for these engines: the section is on, or autotuning is."""
    return engine._config.flops_profiler_config.enabled or engine.autotuning_enabled()


def _with_flops_profiler(original_init):
    """DeepSpeed gap: with flops_profiler_enabled() False, 0.19.8 gives no engine.flops_profiler, which
    its own tests, the autotuner and user code read. Ours takes its place, on every rank."""
    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        _engines_in_init.append(self)
        try:
            original_init(self, *args, **kwargs)
        finally:
            _engines_in_init.remove(self)
        if not wants_profiler(self):
            return
        check_section(self._config.flops_profiler_config)
        self.flops_profiler = UserCodeFlopsProfiler(self)
        if self.autotuning_enabled() and not self.wall_clock_breakdown():
            # The autotuning metric reads the global timers, which 0.19.8 enables through flops_profiler_enabled().
            self.engine_timers = ds_engine.EngineTimers(enable_micro_timers=False, enable_global_timers=True)

    return __init__


# The engines whose __init__ is running (innermost last): the start-up log line belongs to the last.
_engines_in_init = []
START_UP_LINE = "DeepSpeed Flops Profiler Enabled: "


def _true_start_up_line(original_log_dist):
    """DeepSpeed's start-up line reads flops_profiler_enabled(), which these patches make False: it would say
    'False' with the section on. The line says what the engine's config asks."""
    @functools.wraps(original_log_dist)
    def log_dist(message, *args, **kwargs):
        if _engines_in_init and isinstance(message, str) and message.startswith(START_UP_LINE):
            enabled = wants_profiler(_engines_in_init[-1])
            message = START_UP_LINE + (f"{enabled} (served by the patches' pipeline-aware profiler)" if enabled
                                       else "False")
        return original_log_dist(message, *args, **kwargs)

    return log_dist


def check_section(section):
    """Refuse (PatchConfigError, a ValueError) what the section asks and our profiler cannot honour."""
    if section.recompute_fwd_factor:
        raise PatchConfigError(
            f"flops_profiler.recompute_fwd_factor {section.recompute_fwd_factor:g} is not used: recompute "
            "FLOPs are measured (recompute_flops in the report); remove the key or set it to 0")


def _engine_profiler_never_enabled(self):
    """DeepSpeed bug: its FlopsProfiler runs on global rank 0 only, from step() only (PipelineEngine never
    calls it), and miscounts the pipeline: the section is served by our profiler instead."""
    return False


def _section_serves(engine):
    """The section (or autotuning) is on, no --profile-flops-step flag overrides it, the engine has our
    engine.flops_profiler, and the user is not profiling it right now."""
    ours = hasattr(engine.__dict__.get("flops_profiler"), "hold")  # not DeepSpeed's (an engine built unpatched)
    return _state["flag_step"] is None and wants_profiler(engine) and ours and not engine.__dict__.get(ACTIVE)


class SectionOutput:
    """What the section does with its report: global rank 0 prints it as the section asks, or, under autotuning,
    the engine gets DeepSpeed's autotuning metrics; engine.flops_profiler holds it afterwards on every rank."""

    def deliver(self, reports: GatheredReports, step: int) -> None:
        """Collective: every rank of every stage profiled this step, and every rank is here."""
        engine = reports.measurement.engine
        config = engine._config.flops_profiler_config
        report = reports.report(step)
        if engine.autotuning_enabled():
            _set_autotuning_metric(engine, report)
        else:
            try:
                text = format_report(report, module_depth=config.module_depth, top_modules=config.top_modules,
                                     detailed=config.detailed) if reports.emits_here else ""
                reports.emit(text, config.output_file)
            except ReportWriteError as error:  # every rank has it: training goes on on every rank
                warn_on_rank_0(f"flops_profiler: {error}; training goes on")
        engine.flops_profiler.hold(report)


def _set_autotuning_metric(engine, report):
    """DeepSpeed's _autotuning_exit reads engine.flops as one micro-batch's fwd + bwd FLOPs per GPU (its own
    profiler guesses 3x the forward); ours is the measured forward + backward."""
    totals, layout = report["totals"], report["parallelism"]
    micro_batches = layout["micro_batches"]
    gpus = layout["pipeline_parallel_size"] * layout["tensor_parallel_size"]
    engine.flops = (totals["fwd_flops"] + totals["bwd_flops"]) / (micro_batches * gpus)
    engine.fwd_duration = totals["fwd_latency_s"] / micro_batches


# ---------------------------------------------------------------- PipelineEngine
# Each engine's profile schedule, in DeepSpeed's numbering (an iteration is the global_steps its batch starts at).
_SCHEDULES = weakref.WeakKeyDictionary()


def _schedule_of(engine):
    if engine not in _SCHEDULES:  # (nothing in a schedule holds the engine: the entry goes with it)
        _SCHEDULES[engine] = ProfileSchedule(engine.flops_profiler_profile_step(), describe_run, SectionOutput(),
                                             shapes_change=shapes_change_of(engine))
    return _SCHEDULES[engine]


def shapes_change_of(engine):
    """Why the engine's iterations differ in shape, as its config says (None: they need not): DeepSpeed's legacy
    curriculum learning truncates each batch to the current difficulty, its data-efficiency curriculum and
    random-LTD change the tokens a layer sees."""
    reasons = []
    legacy = getattr(engine, "curriculum_enabled_legacy", None)  # the curriculum_learning section (<= 0.19.6)
    if callable(legacy) and legacy():
        reasons.append("curriculum learning (the DeepSpeed config's curriculum_learning section)")
    if getattr(engine, "data_efficiency_enabled", lambda: False)():
        if engine.curriculum_learning_enabled():
            reasons.append("data-efficiency curriculum learning")
        if engine.random_ltd_enabled():
            reasons.append("random-LTD")
    return ", ".join(reasons) or None


def _profiling_train_batch(original_train_batch):
    def train_batch(self, data_iter=None):
        """DeepSpeed gap: the section's profiler lives in DeepSpeedEngine.step(), which PipelineEngine never calls."""
        if not _section_serves(self):
            return original_train_batch(self, data_iter)

        def run_batch():  # while measured, the profiler's timed train_batch (shadowing the engine's); else DeepSpeed's
            return self.__dict__["train_batch"](data_iter) if self.__dict__.get(ACTIVE) else \
                original_train_batch(self, data_iter)

        return _schedule_of(self).run(self, self.global_steps, run_batch)

    train_batch.__wrapped__ = original_train_batch
    return train_batch


# ---------------------------------------------------------------- plain DeepSpeedEngine
def _profiling_forward(original_forward):
    def forward(self, *inputs, **kwargs):
        """DeepSpeed gap: the section's profiler counts global rank 0's first forward micro-batch only."""
        if isinstance(self, PipelineEngine) or not _section_serves(self) or \
                self.global_steps != self.flops_profiler_profile_step():
            return original_forward(self, *inputs, **kwargs)
        measurement = StageMeasurement(self)
        measurement.start()  # shadows forward, backward and step on this engine with timed ones
        timed_step = self.step

        def step(*args, **kwargs):
            steps_before = self.global_steps
            result = timed_step(*args, **kwargs)
            if self.global_steps != steps_before:  # the accumulation boundary closed the profiled step
                measurement.stop()
                # (detaching removes this wrapper with the rest)
                report_and_detach(measurement, steps_before, SectionOutput())
            return result

        self.step = step
        try:
            return self.forward(*inputs, **kwargs)  # the profiler's timed forward
        except BaseException:
            measurement.detach()
            raise

    forward.__wrapped__ = original_forward
    return forward
