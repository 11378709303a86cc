"""PipelineFlopsProfiler: DeepSpeed's FlopsProfiler API, made true for PipelineEngine (and DeepSpeedEngine).

    prof = PipelineFlopsProfiler(engine)
    prof.start_profile()
    engine.train_batch(data_iter)        # or forward/backward/step on a plain DeepSpeedEngine
    prof.stop_profile()
    prof.print_model_profile(profile_step=N)   # collective: every rank calls it; rank 0 prints
    report = prof.get_report()                 # collective; the same dict on every rank
    prof.write_json(path); prof.write_trace(path)   # collective; rank 0 writes
    prof.end_profile()

Every rank of every stage measures its own stage: forward, backward and recompute FLOPs and
latencies per module, and every schedule instruction. get_report gathers the reported replica's
measurements (and a few timings of every rank) to global rank 0, which builds the report and
broadcasts it (gather.py: the cost does not grow with data parallelism); only global rank 0 prints
and writes files. The replica's clocks are aligned to rank 0's (gather.measure_clock_offset), so
that the stages' events share one time line: the bubble analysis and the Chrome trace (trace.py)
use it. The trace's module slices travel from replica 0's ranks to rank 0 only (gather_replica).

This class only sequences the parts: engine_hooks.py attaches to the engine, module_profiler.py
counts and times modules, gather.py moves the measurements, report.py builds the report, files.py
and trace.py write it.
"""
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine

from patches.profiler.engine_hooks import EngineHooks
from patches.profiler.files import write_json, write_text, write_trace
from patches.profiler.gather import (
    EngineLayout,
    RankEntry,
    ReportGroups,
    RunMeta,
    build_rank_entry,
    gather_replica,
    gather_report,
)
from patches.profiler.gather import measure_clock_offset as measure_clock_offset  # its former home
from patches.profiler.module_profiler import ModuleProfiler
from patches.profiler.printer import (
    duration_to_string,
    format_aggregated,
    format_report,
    number_to_string,
    params_to_string,
)
from patches.profiler.report import build_report
from patches.profiler.trace import build_trace


@dataclass(frozen=True)
class CountingPass:
    """The FLOPs of one iteration, counted by a dispatch mode (count_iteration), for the profiled iteration
    after it to take instead of counting on its own timed path."""
    iteration: int
    module_profiler: ModuleProfiler  # stopped, hooks removed: its counts stay readable


def count_iteration(engine: DeepSpeedEngine, iteration: int, run_step: Callable[[], Any]) -> Tuple[Any,
                                                                                                   CountingPass]:
    """Run one iteration (run_step) with FLOPs counted on this rank: (its result, the CountingPass). Local: no
    collective; its timings are not kept."""
    profiler = PipelineFlopsProfiler(engine)
    profiler.start_measuring()
    try:
        result = run_step()
    finally:
        profiler.end_profile()
    return result, CountingPass(iteration, profiler.module_profiler)


class PipelineFlopsProfiler:
    def __init__(self, engine: DeepSpeedEngine, seq_length: Optional[int] = None, analytic: Optional[dict] = None,
                 peak_tflops: Optional[float] = None, activation_checkpointing: Optional[bool] = None,
                 recompute_note: Optional[str] = None, counting_pass: Optional[CountingPass] = None):
        """analytic: the Megatron-LM formula's {'fwd_flops','bwd_flops','recompute_flops'}, or None.
        activation_checkpointing: whether the model checkpoints (None: read from a PipelineModule's interval;
        a plain engine's model may checkpoint on its own). recompute_note: the report's one line on layers
        recomputed short of what was asked, or None. counting_pass: the previous iteration's FLOPs
        (count_iteration); the profiled iteration then runs without a dispatch mode and takes those, with its
        own calls checked against them. None: FLOPs are counted in the profiled iteration itself."""
        self.engine = engine
        self._layout: Optional[EngineLayout] = None
        self.seq_length = seq_length
        self.analytic = analytic
        self.peak_tflops = peak_tflops
        self.activation_checkpointing = activation_checkpointing
        self.recompute_note = recompute_note
        self.counting_pass = counting_pass
        self.calls_differ: List[str] = []  # modules whose calls differ from the counting pass's
        self.accelerator = get_accelerator()
        self.module_profiler: Optional[ModuleProfiler] = None
        self.hooks: Optional[EngineHooks] = None
        self._report: Optional[dict] = None
        self._entries = None
        self._groups: Optional[ReportGroups] = None
        self._skipped_steps_before = 0
        self.started = False
        # DeepSpeed's FlopsProfiler attributes, set when a report is built (print_model_profile, get_report).
        self.flops = self.macs = self.params = None

    @property
    def layout(self) -> EngineLayout:
        # Read on first use: DeepSpeed's engine makes its profiler before a PipelineEngine has its grid.
        if self._layout is None:
            self._layout = EngineLayout.of(self.engine)
        return self._layout

    # ------------------------------------------------------------------ measuring
    def start_profile(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        """Install every hook and timer (afresh, if profiled before). Local: no rank waits for another.

        ignore_list: module types left out of the profile, as in DeepSpeed (their flops, latencies and
        params are not in the report, nor in their ancestors' totals)."""
        self.start_measuring(ignore_list)

    def start_measuring(self, ignore_list: Optional[Iterable[type]] = None,
                        after_train_batch: Optional[Callable[[], None]] = None) -> None:
        """after_train_batch: called on this rank when the profiled train_batch returns (pipelines)."""
        if self.started:
            return
        self._remove_hooks()  # profiled before and not ended: start afresh, with this ignore_list
        module = self.engine.module
        self.module_profiler = ModuleProfiler(module, synchronize=self.accelerator.synchronize,
                                              root_name=type(module).__name__, ignore_types=ignore_list,
                                              count_flops=self.counting_pass is None)
        self.hooks = EngineHooks(self.engine, self.layout, self.module_profiler, self.accelerator.synchronize,
                                 after_train_batch)
        self.hooks.install()
        if self.accelerator.device_name() != "cpu":
            self.accelerator.reset_peak_memory_stats()
        self._report = None
        self.calls_differ = []
        self._skipped_steps_before = getattr(self.engine, "skipped_steps", 0)
        self.module_profiler.start()
        self.hooks.open_window()
        self.started = True
        self.engine.flops_profiling_active = True  # patches fix DeepSpeed's timers for profiled engines

    def stop_profile(self) -> None:
        if not self.started:
            return
        self.hooks.close_window()
        self.module_profiler.stop()
        if self.counting_pass is not None:
            self.calls_differ = self.module_profiler.adopt_counts(self.counting_pass.module_profiler)
        self.started = False

    def end_profile(self) -> None:
        """Remove every hook, wrapper and swapped function: the engine runs as if never profiled."""
        self.stop_profile()
        self.engine.__dict__.pop("flops_profiling_active", None)
        self._remove_hooks()

    def _remove_hooks(self):
        # The measurements stay readable (get_report, the getters); only the attachments go.
        if self.hooks is not None:
            self.hooks.remove()
        if self.module_profiler is not None:
            self.module_profiler.remove()

    def rank_entry(self) -> RankEntry:
        """This rank's measurements of the profiled step (not collective)."""
        if self.module_profiler is None:
            raise RuntimeError("start_profile() never ran on this rank: nothing was measured")
        peak = None
        if self.accelerator.device_name() != "cpu":
            peak = int(self.accelerator.max_memory_allocated())
        counted = self.counting_pass.iteration if self.counting_pass is not None else None
        return build_rank_entry(self.layout, self.engine.module, self.module_profiler, self.hooks.instructions,
                                self.hooks.train_batch_s(), peak, counted, self.calls_differ)

    # ------------------------------------------------------------------ reporting
    def _make_groups(self):
        if self._groups is None:
            self._groups = ReportGroups.for_layout(self.layout)

    def get_report(self, profile_step: Optional[int] = None) -> dict:
        """Collective over the world group: every rank must call it (a rank that never started names itself
        in the error every rank raises). Returns the schema's dict."""
        if self._report is None or (profile_step is not None and self._report["step"] != profile_step):
            self._make_groups()  # collective: made here, where every rank is, never in start_profile
            result = gather_report(
                self.layout, self._groups, self.rank_entry,
                lambda: RunMeta.of(self.engine, self.layout,
                                   profile_step if profile_step is not None else self.engine.global_steps,
                                   self.seq_length, self.analytic, self.peak_tflops, self.activation_checkpointing,
                                   self.accelerator.device_name(), self._skipped_steps_before,
                                   self.recompute_note),
                build_report)
            self._report = result.report
            self._entries = result.replica_entries
            self.flops, self.macs, self.params = self.get_total_flops(), self.get_total_macs(), self.get_total_params()
        return self._report

    # ------------------------------------------------------------------ DeepSpeed's FlopsProfiler getters
    # DeepSpeed's meaning: forward FLOPs, MACs and forward duration of the profiled model, and its params.
    # Once a report is built (after the profiled step), they are the gathered whole-model values, the same
    # on every rank: one replica, every micro-batch of the step. Before that, this rank's own counts so far.
    # They never gather, so one rank may call them alone.
    def _totals(self):
        if self._report is not None:
            totals = self._report["totals"]
            return totals["fwd_flops"], totals["params"], totals["fwd_latency_s"]
        if self.module_profiler is None:
            return 0, 0, 0.0
        tree = self.module_profiler.tree()
        return tree["fwd_flops"], tree["params"], tree["fwd_latency_s"]

    def get_total_flops(self, as_string: bool = False) -> Union[int, str]:
        flops = self._totals()[0]
        return _with_unit(number_to_string(flops), "FLOPS") if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> Union[int, str]:
        """Matrix work is 2 FLOPs per multiply-accumulate, so MACs are half the forward FLOPs."""
        macs = self._totals()[0] // 2
        return _with_unit(number_to_string(macs), "MACs") if as_string else macs

    def get_total_params(self, as_string: bool = False) -> Union[int, str]:
        params = self._totals()[1]
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> Union[float, str]:
        duration = self._totals()[2]
        return duration_to_string(duration) if as_string else duration

    def reset_profile(self) -> None:
        """Zero the counts and timings gathered so far; profiling, if started, goes on."""
        if self.module_profiler is not None:
            self.module_profiler.reset()
        if self.hooks is not None:
            self.hooks.reset()
        self._report = None

    def print_model_profile(self, profile_step: Optional[int] = None, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: Optional[str] = None) -> None:
        """Collective. Global rank 0 prints the report (or writes it to output_file); a failed write raises
        ReportWriteError on every rank."""
        report = self.get_report(profile_step)
        text = format_report(report, module_depth=module_depth, top_modules=top_modules,
                             detailed=detailed) if dist.get_rank() == 0 else ""
        if output_file:
            self._rank0_writes(lambda: write_text(text, output_file), output_file)
        elif text:
            print(text, flush=True)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Collective. Global rank 0 prints the top module types per depth of the whole model."""
        report = self.get_report()
        if dist.get_rank() == 0:
            print("\n".join(format_aggregated(report, module_depth, top_modules)), flush=True)

    def is_expert_tensor_parallelism_enabled(self) -> bool:
        """DeepSpeed's meaning: a MoE layer of the model shards its experts over tensor ranks."""
        from deepspeed.moe.layer import MoE

        return any(getattr(m, "enable_expert_tensor_parallelism", False)
                   for m in self.engine.module.modules() if isinstance(m, MoE))

    def write_json(self, path: str, profile_step: Optional[int] = None) -> None:
        """Collective (it gathers if needed). Global rank 0 writes the schema's JSON to path; a failed write
        raises ReportWriteError on every rank."""
        report = self.get_report(profile_step)
        self._rank0_writes(lambda: write_json(report, path), path)

    def write_trace(self, path: str, profile_step: Optional[int] = None) -> None:
        """Collective. Global rank 0 writes the Chrome trace (Perfetto, chrome://tracing) of the
        reported replica to path: a process per stage, a track per tensor rank (trace.py)."""
        report = self.get_report(profile_step)
        gathered = None
        if self.layout.in_replica:  # the trace shows replica 0 only; its ranks alone gather
            gathered = gather_replica((dist.get_rank(), self.module_profiler.events()), self.layout, self._groups)
        self._rank0_writes(lambda: write_trace(build_trace(self._entries, dict(gathered), report["step"]), path), path)

    def _rank0_writes(self, write: Callable[[], None], path: str) -> None:
        """Collective: rank 0 runs write(); its OSError reaches every rank at once (a broadcast), so no rank
        trains on into a collective that rank 0, gone, never enters."""
        outcome = [None]
        if dist.get_rank() == 0:
            try:
                write()
            except OSError as error:
                outcome[0] = f"{type(error).__name__}: {error}"
        dist.broadcast_object_list(outcome, src=0, group=self._groups.world)
        if outcome[0] is not None:
            raise ReportWriteError(f"the profile report was not written to {path} on rank 0: {outcome[0]}")


class ReportWriteError(OSError):
    """Global rank 0 could not write a report file; raised on every rank with rank 0's reason."""


def _with_unit(text, unit):
    return f"{text}{unit}" if text[-1].isalpha() else f"{text} {unit}"
