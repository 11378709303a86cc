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
"""
import functools
import time

import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron.profiler.gather import (
    EngineLayout,
    ReportGroups,
    RunMeta,
    build_rank_entry,
    gather_replica,
    gather_report,
)
from megatron.profiler.gather import measure_clock_offset as measure_clock_offset  # its former home
from megatron.profiler.instruction_timer import InstructionTimer
from megatron.profiler.module_profiler import ModuleProfiler
from megatron.profiler.printer import duration_to_string, format_report, number_to_string, params_to_string
from megatron.profiler.report import build_report, write_json
from megatron.profiler.trace import build_trace, write_trace

# A plain DeepSpeedEngine has no schedule: its forward, backward and step are timed as the
# pipeline instructions they correspond to.
_PLAIN_ENGINE_INSTRUCTIONS = {"forward": "ForwardPass", "backward": "BackwardPass", "step": "OptimizerStep"}


class PipelineFlopsProfiler:
    def __init__(self, engine, seq_length=None, analytic=None, peak_tflops=None, activation_checkpointing=None):
        """analytic: the Megatron-LM formula's {'fwd_flops','bwd_flops','recompute_flops'}, or None."""
        self.engine = engine
        self.is_pipeline = isinstance(engine, PipelineEngine)
        self.seq_length = seq_length
        self.analytic = analytic
        self.peak_tflops = peak_tflops
        self.activation_checkpointing = activation_checkpointing
        self.accelerator = get_accelerator()
        self.module_profiler = None
        self.instruction_timer = None
        self._swapped_forward_funcs = []
        self._restore_engine_methods = []
        self._window = None  # (start, end) of the profiled work, for the plain engine
        self._train_batch_s = 0.0
        self._report = None
        self._entries = None
        self.layout = None
        self._groups = None
        self.started = False
        # DeepSpeed's FlopsProfiler attributes, set when a report is built (print_model_profile, get_report).
        self.flops = self.macs = self.params = None

    # ------------------------------------------------------------------ measuring
    def start_profile(self, ignore_list=None):
        """Install every hook and timer. Collective the first time (every rank makes the report's groups).

        ignore_list: module types left out of the profile, as in DeepSpeed (their flops, latencies and
        params are not in the report, nor in their ancestors' totals)."""
        if self.started:
            return
        self._make_groups()
        module = self.engine.module
        self.module_profiler = ModuleProfiler(module, synchronize=self.accelerator.synchronize,
                                              root_name=type(module).__name__, ignore_types=ignore_list)
        self.instruction_timer = InstructionTimer(self.engine, self.accelerator.synchronize)
        if self.is_pipeline:
            self._credit_tied_forward_fns(module)
            self.instruction_timer.install()
            self._wrap_engine_method("train_batch", self._timed_train_batch)
        else:
            for method, instruction in _PLAIN_ENGINE_INSTRUCTIONS.items():
                original = _unpatched(getattr(type(self.engine), method))
                self._wrap_engine_method(method, self._bound(self.instruction_timer.timed(instruction, original)))
        if self.accelerator.device_name() != "cpu":
            self.accelerator.reset_peak_memory_stats()
        self._report = None
        self._train_batch_s = 0.0
        self._skipped_steps_before = getattr(self.engine, "skipped_steps", 0)
        self.module_profiler.start()
        self.accelerator.synchronize()
        self._window = [time.perf_counter(), None]
        self.started = True
        self.engine.flops_profiling_active = True  # patches fix DeepSpeed's timers for profiled engines

    def stop_profile(self):
        if not self.started:
            return
        self.accelerator.synchronize()
        self._window[1] = time.perf_counter()
        self.module_profiler.stop()
        self.started = False

    def end_profile(self):
        """Remove every hook, wrapper and swapped function: the engine runs as if never profiled."""
        self.stop_profile()
        self.engine.__dict__.pop("flops_profiling_active", None)
        for restore in reversed(self._restore_engine_methods):
            restore()
        self._restore_engine_methods = []
        for funcs, index, original in self._swapped_forward_funcs:
            funcs[index] = original
        self._swapped_forward_funcs = []
        if self.instruction_timer is not None:
            self.instruction_timer.remove()
        if self.module_profiler is not None:
            self.module_profiler.remove()

    def _credit_tied_forward_fns(self, module):
        """TiedLayerSpec(forward_fn=...) entries are partial(fn, tied_module): plain calls, no hooks.

        Swap each for a proxy that runs the same function under the tied module's scope.
        """
        tied = set(id(m) for m in getattr(module, "tied_modules", {}).values())
        funcs = getattr(module, "forward_funcs", [])
        for index, func in enumerate(funcs):
            if isinstance(func, functools.partial) and func.args and id(func.args[0]) in tied and len(func.args) == 1:
                proxy = self.module_profiler.scoped_call(func.args[0], func.func)
                self._swapped_forward_funcs.append((funcs, index, func))
                funcs[index] = proxy

    def _wrap_engine_method(self, name, replacement):
        """Shadow a method on this engine instance only; restoring deletes the instance attribute."""
        engine = self.engine
        had_instance_attr = name in engine.__dict__
        previous = engine.__dict__.get(name)
        setattr(engine, name, replacement)

        def restore():
            if had_instance_attr:
                setattr(engine, name, previous)
            else:
                delattr(engine, name)
        self._restore_engine_methods.append(restore)

    def _bound(self, fn):
        engine = self.engine
        return lambda *args, **kwargs: fn(engine, *args, **kwargs)

    def _timed_train_batch(self, *args, **kwargs):
        self.accelerator.synchronize()
        start = time.perf_counter()
        try:
            return _unpatched(type(self.engine).train_batch)(self.engine, *args, **kwargs)
        finally:
            self.accelerator.synchronize()
            self._train_batch_s += time.perf_counter() - start

    # ------------------------------------------------------------------ reporting
    def _make_groups(self):
        if self._groups is None:
            self.layout = EngineLayout.of(self.engine)
            self._groups = ReportGroups.for_layout(self.layout)

    def get_report(self, profile_step=None):
        """Collective over the world group: every rank must call it. Returns the schema's dict."""
        if self._report is None or (profile_step is not None and self._report["step"] != profile_step):
            self._make_groups()  # already made by start_profile, unless it never ran
            result = gather_report(
                self.layout, self._groups, lambda: build_rank_entry(self, self.layout),
                lambda: RunMeta.of(self.engine, self.layout,
                                   profile_step if profile_step is not None else self.engine.global_steps,
                                   self.seq_length, self.analytic, self.peak_tflops, self.activation_checkpointing,
                                   self.accelerator.device_name(), getattr(self, "_skipped_steps_before", 0)),
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

    def get_total_flops(self, as_string=False):
        flops = self._totals()[0]
        return _with_unit(number_to_string(flops), "FLOPS") if as_string else flops

    def get_total_macs(self, as_string=False):
        """Matrix work is 2 FLOPs per multiply-accumulate, so MACs are half the forward FLOPs."""
        macs = self._totals()[0] // 2
        return _with_unit(number_to_string(macs), "MACs") if as_string else macs

    def get_total_params(self, as_string=False):
        params = self._totals()[1]
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string=False):
        duration = self._totals()[2]
        return duration_to_string(duration) if as_string else duration

    def reset_profile(self):
        """Zero the counts and timings gathered so far; profiling, if started, goes on."""
        if self.module_profiler is not None:
            self.module_profiler.reset()
        if self.instruction_timer is not None:
            self.instruction_timer.reset()
        self._report = None
        self._train_batch_s = 0.0
        if self.started:
            self._window = [time.perf_counter(), None]

    def print_model_profile(self, profile_step=None, module_depth=-1, top_modules=1, detailed=True, output_file=None):
        """Collective. Global rank 0 prints the report (or writes it to output_file)."""
        report = self.get_report(profile_step)
        if dist.get_rank() != 0:
            return
        text = format_report(report, module_depth=module_depth, top_modules=top_modules, detailed=detailed)
        if output_file:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            print(text, flush=True)

    def write_json(self, path, profile_step=None):
        """Collective (it gathers if needed). Global rank 0 writes the schema's JSON to path."""
        report = self.get_report(profile_step)
        if dist.get_rank() == 0:
            write_json(report, path)

    def write_trace(self, path, profile_step=None):
        """Collective. Global rank 0 writes the Chrome trace (Perfetto, chrome://tracing) of the
        reported replica to path: a process per stage, a track per tensor rank (trace.py)."""
        report = self.get_report(profile_step)
        if not self.layout.in_replica:  # the trace shows replica 0 only; its ranks alone gather
            return
        gathered = gather_replica((dist.get_rank(), self.module_profiler.events()), self.layout, self._groups)
        if gathered is not None:
            write_trace(build_trace(self._entries, dict(gathered), report["step"]), path)


def _unpatched(method):
    """patches wraps the engines' train_batch, forward and step; the profiler itself runs the originals."""
    return getattr(method, "__wrapped__", method)


def _with_unit(text, unit):
    return f"{text}{unit}" if text[-1].isalpha() else f"{text} {unit}"
