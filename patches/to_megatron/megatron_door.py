"""--profile-flops-step in a Megatron training loop: one door for our GPT fork's train() and upstream
Megatron-DeepSpeed's train_step (patched by megatron_upstream.py), each tree telling it of its run through one
adapter (MegatronRun: ours in megatron/training.py, upstream's in upstream_run.py).

    door = MegatronDoor(args, run, first_done=args.iteration)        # says the start-up line through run
    loss = door.train_step(engine, iteration, lambda: train_step(...))  # every iteration
    door.finish()                                                     # where the loop ends

Every iteration runs through the door's profile schedule (profiler/one_step.py): iteration N is profiled on
every rank, N-1 counts its FLOPs, the others are timed for the unprofiled baseline. N's report waits for the
STEADY_AFTER unprofiled iterations after N (its baseline: a run profiled early has only warm-up before N), or
for the run's last iteration, or for the loop's end (finish()), whichever comes first. The door takes the engine
over on its first iteration: its attachment (profiler/attachment.py) gets the run's description (again at every
iteration of a run whose shapes change), so that the reports this loop does not ask for itself (the config
section's, the user's own FlopsProfiler code's) describe the run as well; and with --profile-flops-step the config
section stays out of the engine. The profiled
iteration's report is delivered by FileOutput: printed on global rank 0, flops_profile_stepN.json,
pipeline_trace_stepN.json and the page flops_profile_stepN.html written, TensorBoard scalars where the rank has a
writer.
"""
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, TypeVar

from deepspeed.runtime.engine import DeepSpeedEngine

from patches.page import write_profile_page
from patches.profiler.attachment import attachment_of
from patches.profiler.context import UNDESCRIBED, RunDescription
from patches.profiler.files import write_json, write_tensorboard_scalars, write_trace
from patches.profiler.one_step import STEADY_AFTER, ProfileSchedule
from patches.profiler.sources import GatheredReports, ReportWriteError, print_report, warn_on_rank_0, warned_not_built

Result = TypeVar("Result")


@dataclass(frozen=True)
class FileOutput:
    """What --profile-flops-step does with its report: global rank 0 prints it and writes
    flops_profile_stepN.json, pipeline_trace_stepN.json and the page flops_profile_stepN.html (where plotly is
    installed) into `directory`; a TensorBoard writer (where the rank has one) gets the headline scalars. A file
    rank 0 cannot write is one warning line; training goes on."""
    directory: str
    tensorboard_writer: Any = None

    def json_path(self, step: int) -> str:
        return os.path.join(self.directory, f"flops_profile_step{step}.json")

    def trace_path(self, step: int) -> str:
        return os.path.join(self.directory, f"pipeline_trace_step{step}.json")

    def page_path(self, step: int) -> str:
        return os.path.join(self.directory, f"flops_profile_step{step}.html")

    def deliver(self, reports: GatheredReports, step: int) -> None:
        """Collective: every rank calls it for the same report."""
        try:
            report = print_report(reports, step)
        except Exception as error:  # built again over the iterations after it (rebuild_report): rank 0 failed
            if not warned_not_built(error, f"no report of iteration {step}"):
                raise
            return
        json_path, trace_path = self.json_path(step), self.trace_path(step)
        try:
            # files.write_json makes the directory on rank 0: its failure, too, reaches every rank
            reports.write(lambda: write_json(report, json_path), json_path)
            trace = reports.trace(step)
            reports.write(lambda: write_trace(trace, trace_path), trace_path)
            page_path = self.page_path(step)
            reports.write(lambda: self._write_page(report, trace, page_path), page_path)
        except ReportWriteError as error:  # every rank has it: training goes on, unprofiled, on every rank
            warn_on_rank_0(f"{error}; training goes on")
        if self.tensorboard_writer is not None:
            write_tensorboard_scalars(report, self.tensorboard_writer, step)

    @staticmethod
    def _write_page(report: dict, trace: dict, path: str) -> None:
        """On global rank 0: the page beside the report, or one warning line saying why not (an extra)."""
        problem = write_profile_page(report, trace, path, os.path.basename(path))
        if problem is not None:
            warn_on_rank_0(f"the profile page {problem}; training goes on")


class MegatronRun(Protocol):
    """What a Megatron tree tells the door of its run: each tree keeps only what is its own."""
    tensorboard_writer: Any  # the rank's writer, or None

    # asked at the first iteration, and at every one where the shapes change (curriculum: the iteration's length)
    def describe(self, engine: DeepSpeedEngine) -> RunDescription: ...
    def shapes_change(self) -> Optional[str]: ...  # why its iterations differ in shape (curriculum), or None
    def announce(self, announcement: str) -> None: ...  # the start-up line, through the tree's own log


class MegatronDoor:
    """A Megatron training loop's way into the profiler (see the module docstring)."""

    def __init__(self, args: Any, run: MegatronRun, first_done: int):
        """args: the Megatron arguments (profile_flops_step, profile_flops_output, profile_flops_counting,
        train_iters). run: the tree's adapter. first_done: the iterations done before this run (a resumed run's).
        Where an iteration is profiled, the run announces it (`announcement`: the start-up line's words)."""
        self.profile_step = args.profile_flops_step
        shapes_change = run.shapes_change()
        self.schedule = ProfileSchedule(self.profile_step, counting=args.profile_flops_counting,
                                        shapes_change=shapes_change,
                                        last_iteration=getattr(args, "train_iters", None), settle=STEADY_AFTER,
                                        first_done=first_done)
        self.announcement = (f"iteration {self.profile_step} will be profiled on every stage"
                             f"{self.schedule.announcement}" if self.profile_step is not None else None)
        self.output = FileOutput(args.profile_flops_output, run.tensorboard_writer)
        self.describe = run.describe
        self.describes_each_iteration = shapes_change is not None
        if self.announcement is not None:
            run.announce(self.announcement)

    def train_step(self, engine: DeepSpeedEngine, iteration: int, train_step: Callable[[], Result]) -> Result:
        """Run one iteration (train_step) through the schedule; the profiled one's report is delivered here.
        Collective on the profiled iteration: every rank runs the same iterations through its door."""
        attachment = attachment_of(engine)
        if attachment.run is None or self.describes_each_iteration:
            attachment.run = self._described(engine)
        if self.profile_step is not None:
            attachment.section = None  # --profile-flops-step takes precedence over the config section
        result, profiled = self.schedule.run(engine, attachment, iteration, train_step)
        if profiled is not None:
            self.output.deliver(profiled, profiled.step)
        return result

    def _described(self, engine: DeepSpeedEngine) -> RunDescription:
        """The run's description; one that fails is a warning and a report without its lines, never the run's end
        (and is not asked again: one warning, not one an iteration)."""
        try:
            return self.describe(engine)
        except Exception as error:
            self.describes_each_iteration = False
            warn_on_rank_0(f"FLOPs profiler: the run is not described in its report ({type(error).__name__}: {error})")
            return UNDESCRIBED

    def finish(self) -> None:
        """The loop has ended (collective: every rank's loop ends at the same iteration): a report still waiting
        for its baseline iterations is delivered now, over those that ran."""
        profiled = self.schedule.flush()
        if profiled is not None:
            self.output.deliver(profiled, profiled.step)
