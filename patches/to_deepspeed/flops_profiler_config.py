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
2. Each engine whose section is on gets a SectionDoor (on its attachment, profiler/attachment.py): the
   engine's iterations run through its profile schedule (profiler/one_step.py, as --profile-flops-step's
   do), in DeepSpeed's numbering: the iteration that starts when global_steps == profile_step is profiled
   on every rank of every stage, the one before it counts its FLOPs. A PipelineEngine's iteration is its
   train_batch; a plain DeepSpeedEngine's runs from its first forward to the step() that advances
   global_steps, and counts its FLOPs in itself. engine_methods.py hands the iterations over.
3. The door delivers the report: gathered at a point every rank passes, printed from global rank 0,
   honouring module_depth, top_modules, detailed and output_file (an output_file that cannot be written is
   one warning line on rank 0; training goes on on every rank); under autotuning, DeepSpeed's metrics
   instead. engine.flops_profiler then holds it, for the getters on any rank.
A training loop with --profile-flops-step takes the engine over (megatron_door.py): the section then stays
out of it. (The wall-clock timer fixes are pipeline_timers.py and section_timers.py.)
"""
import contextlib
from typing import Callable, Iterator, Optional, TypeVar

import deepspeed.runtime.engine as ds_engine
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from patches.process.errors import PatchConfigError
from patches.profiler.attachment import EngineAttachment
from patches.profiler.numbering import DEEPSPEED_NUMBERING, running_iteration
from patches.profiler.one_step import COUNT_IN_PREVIOUS, COUNT_IN_PROFILED, ProfileSchedule
from patches.profiler.sources import GatheredReports, ReportWriteError, print_report, warn_on_rank_0, warned_not_built
from patches.profiler.user_code_profiler import UserCodeFlopsProfiler

WHAT_IT_FIXES = "the flops_profiler section (and engine.flops_profiler)"
START_UP_LINE = "DeepSpeed Flops Profiler Enabled: "

Result = TypeVar("Result")


def requires():
    """What these patches and the profiler they start use of DeepSpeed (private names included)."""
    return [(DeepSpeedEngine, name) for name in ("flops_profiler_enabled", "flops_profiler_profile_step",
                                                 "autotuning_enabled", "wall_clock_breakdown")] + \
        [(PipelineEngine, "_INSTRUCTION_MAP"), (PipelineEngine, "_exec_schedule"),
         (ds_engine, "EngineTimers"), (ds_engine, "log_dist")]


def install():
    DeepSpeedEngine.flops_profiler_enabled = _engine_profiler_never_enabled


def wants_profiler(engine):
    """DeepSpeed builds its FlopsProfiler for these engines: the section is on, or autotuning is."""
    return engine._config.flops_profiler_config.enabled or engine.autotuning_enabled()


def engine_built(engine, attachment: EngineAttachment):
    """DeepSpeed gap: with flops_profiler_enabled() False, 0.19.8 gives no engine.flops_profiler, which
    its own tests, the autotuner and user code read. Ours takes its place, on every rank; the section's door
    serves the engine's iterations."""
    if not wants_profiler(engine):
        return
    check_section(engine._config.flops_profiler_config)
    engine.flops_profiler = UserCodeFlopsProfiler(engine)
    attachment.section = SectionDoor(engine, attachment)
    if engine.autotuning_enabled() and not engine.wall_clock_breakdown():
        # The autotuning metric reads the global timers, which 0.19.8 enables through flops_profiler_enabled().
        engine.engine_timers = ds_engine.EngineTimers(enable_micro_timers=False, enable_global_timers=True)


@contextlib.contextmanager
def true_start_up_line(engine) -> Iterator[None]:
    """While `engine`'s __init__ runs: DeepSpeed's start-up line reads flops_profiler_enabled(), which these
    patches make False, so it would say 'False' with the section on; the line says what the config asks."""
    original_log_dist = ds_engine.log_dist

    def log_dist(message, *args, **kwargs):
        if isinstance(message, str) and message.startswith(START_UP_LINE):
            enabled = wants_profiler(engine)
            message = START_UP_LINE + (f"{enabled} (served by the patches' pipeline-aware profiler)" if enabled
                                       else "False")
        return original_log_dist(message, *args, **kwargs)

    ds_engine.log_dist = log_dist
    try:
        yield
    finally:
        ds_engine.log_dist = original_log_dist


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


class SectionDoor:
    """The config section's schedule for one engine, and what it does with its report (see the module
    docstring). Nothing in it holds the engine."""

    def __init__(self, engine: DeepSpeedEngine, attachment: EngineAttachment):
        self.config = engine._config.flops_profiler_config
        self.attachment = attachment  # the engine's, which holds this door (attachment.section)
        # a plain engine's iteration is several calls: its FLOPs are counted in it, as DeepSpeed's profiler does
        counting = COUNT_IN_PREVIOUS if self.attachment.runs_a_schedule else COUNT_IN_PROFILED
        self.schedule = ProfileSchedule(engine.flops_profiler_profile_step(), counting=counting,
                                        shapes_change=shapes_change_of(engine))

    # ------------------------------------------------------------ a PipelineEngine: one train_batch
    def run_batch(self, engine: PipelineEngine, train_batch: Callable[[], Result]) -> Result:
        """DeepSpeed gap: the section's profiler lives in DeepSpeedEngine.step(), which PipelineEngine never calls."""
        iteration = running_iteration(engine.global_steps, DEEPSPEED_NUMBERING)
        result, profiled = self.schedule.run(engine, self.attachment, iteration, train_batch)
        if profiled is not None:
            self.deliver(engine, profiled, iteration)
        return result

    # ------------------------------------------------------------ a plain DeepSpeedEngine: forward ... step
    def before_forward(self, engine: DeepSpeedEngine) -> None:
        """DeepSpeed gap: the section's profiler counts global rank 0's first forward micro-batch only. The
        iteration opens at a training forward, unless one is open or the user is measuring the engine."""
        if self.schedule.running is not None or not engine.training or self.attachment.measurement is not None:
            return
        self.schedule.begin(engine, self.attachment, running_iteration(engine.global_steps, DEEPSPEED_NUMBERING))

    def after_step(self, engine: DeepSpeedEngine) -> None:
        """The step closed an iteration (global_steps advanced): end the open one, and deliver its report."""
        iteration = self.schedule.running
        if iteration is None:
            return
        profiled = self.schedule.end()
        if profiled is not None:
            self.deliver(engine, profiled, iteration)

    def abandon(self) -> None:
        """A method of the open iteration raised: nothing stays attached."""
        self.schedule.abandon()

    # ------------------------------------------------------------ the report
    def deliver(self, engine: DeepSpeedEngine, reports: GatheredReports, step: int) -> None:
        """Collective: every rank of every stage profiled this step, and every rank is here. Global rank 0 prints
        the report as the section asks, or, under autotuning, the engine gets DeepSpeed's autotuning metrics;
        engine.flops_profiler holds it afterwards on every rank."""
        config = self.config
        try:
            if engine.autotuning_enabled():
                report = reports.report(step)
                _set_autotuning_metric(engine, report)
            else:
                try:
                    report = print_report(reports, step, config.output_file, module_depth=config.module_depth,
                                          top_modules=config.top_modules, detailed=config.detailed)
                except ReportWriteError as error:  # every rank has it: training goes on on every rank
                    warn_on_rank_0(f"flops_profiler: {error}; training goes on")
                    report = reports.report(step)  # built before the write failed
        except Exception as error:
            if not warned_not_built(error, f"no report of step {step}"):
                raise
            return
        engine.flops_profiler.hold(report)


def _set_autotuning_metric(engine, report):
    """DeepSpeed's _autotuning_exit reads engine.flops as one micro-batch's fwd + bwd FLOPs per GPU (its own
    profiler guesses 3x the forward); ours is the measured forward + backward."""
    totals, layout = report["totals"], report["parallelism"]
    micro_batches = layout["micro_batches"]
    gpus = layout["pipeline_parallel_size"] * layout["tensor_parallel_size"]
    engine.flops = (totals["fwd_flops"] + totals["bwd_flops"]) / (micro_batches * gpus)
    engine.fwd_duration = totals["fwd_latency_s"] / micro_batches


def shapes_change_of(engine) -> Optional[str]:
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
