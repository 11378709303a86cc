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
latencies per module, and every schedule instruction. The per-rank measurements are all-gathered
over the world group (which covers the pipeline, tensor and data groups), so every rank builds the
same report; only global rank 0 prints and writes files. Before gathering, every rank measures its
clock's offset to rank 0's (measure_clock_offset), so that the stages' events share one time line:
the bubble analysis and the Chrome trace (trace.py) use it. The trace's module slices are gathered
to rank 0 only (they are many and only rank 0 writes).
"""
import dataclasses
import functools
import time

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron.profiler.instruction_timer import InstructionTimer
from megatron.profiler.module_profiler import ModuleProfiler
from megatron.profiler.peaks import peak_tflops_for
from megatron.profiler.printer import duration_to_string, format_report, number_to_string, params_to_string
from megatron.profiler.report import build_report, write_json
from megatron.profiler.trace import build_trace, write_trace

# Ping rounds per rank for the clock alignment: the shortest round trip of these bounds the error.
CLOCK_PING_ROUNDS = 8

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
        self.started = False
        # DeepSpeed's FlopsProfiler attributes, set when a report is built (print_model_profile, get_report).
        self.flops = self.macs = self.params = None

    # ------------------------------------------------------------------ measuring
    def start_profile(self, ignore_list=None):
        """Install every hook and timer; local to this rank (no collective).

        ignore_list: module types left out of the profile, as in DeepSpeed (their flops, latencies and
        params are not in the report, nor in their ancestors' totals)."""
        if self.started:
            return
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
    def _local_entry(self):
        engine = self.engine
        stage_id, tp_rank, dp_rank = _coordinates(engine)
        if self.is_pipeline:
            train_batch_s = self._train_batch_s
        else:
            train_batch_s = self._window[1] - self._window[0]
        peak = None
        if self.accelerator.device_name() != "cpu":
            peak = int(self.accelerator.max_memory_allocated())
        tree = self.module_profiler.tree()
        _annotate_replicated_params(engine.module, tree)
        return {
            "global_rank": dist.get_rank(), "stage_id": stage_id, "tp_rank": tp_rank, "dp_rank": dp_rank,
            "modules": tree, "instructions": self.instruction_timer.as_dict(),
            "uncounted_ops": [dataclasses.asdict(op) for op in self.module_profiler.uncounted_ops()],
            "train_batch_latency_s": train_batch_s, "peak_memory_bytes": peak,
            "events": [(name, _plain(kwargs), start, end)
                       for name, kwargs, start, end in self.instruction_timer.events],
        }

    def _meta(self, profile_step):
        engine = self.engine
        pp, tp, dp = _parallel_sizes(engine)
        if self.is_pipeline:
            micro_batches = engine.micro_batches
            checkpointing = engine.module.activation_checkpoint_interval > 0
        else:
            micro_batches = engine.gradient_accumulation_steps()
            checkpointing = bool(self.activation_checkpointing)
        if self.activation_checkpointing is not None:
            checkpointing = bool(self.activation_checkpointing)
        dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        device = self.accelerator.device_name()
        device_name = torch.cuda.get_device_name() if device == "cuda" else device
        peak = self.peak_tflops if self.peak_tflops is not None else peak_tflops_for(device_name, dtype)
        return {
            "step": int(profile_step if profile_step is not None else engine.global_steps),
            "world_size": dist.get_world_size(), "pipeline_parallel_size": pp, "tensor_parallel_size": tp,
            "data_parallel_size": dp, "micro_batches": micro_batches,
            "micro_batch_size": engine.train_micro_batch_size_per_gpu(), "seq_length": self.seq_length,
            "activation_checkpointing": checkpointing, "analytic": self.analytic,
            "peak_tflops": peak, "device_name": device_name, "dtype": dtype,
            # fp16 loss scaling skips the update of a step whose gradients overflowed: timed, but no update
            "optimizer_step_skipped": getattr(engine, "skipped_steps", 0) > getattr(self, "_skipped_steps_before", 0),
        }

    def get_report(self, profile_step=None):
        """Collective over the world group: every rank must call it. Returns the schema's dict."""
        if self._report is None or (profile_step is not None and self._report["step"] != profile_step):
            entry = self._local_entry()
            entry["clock_offset_s"], entry["clock_error_s"] = measure_clock_offset()
            entries = [None] * dist.get_world_size()
            dist.all_gather_object(entries, entry)
            self._report = build_report(entries, self._meta(profile_step))
            self._entries = entries
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
        _, _, dp_rank = _coordinates(self.engine)
        rank = dist.get_rank()
        mine = self.module_profiler.events() if dp_rank == 0 else None
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object((rank, mine), gathered, dst=0)
        if rank == 0:
            module_events = {r: events for r, events in gathered if events is not None}
            write_trace(build_trace(self._entries, module_events, report["step"]), path)


def measure_clock_offset(rounds=CLOCK_PING_ROUNDS, clock=time.perf_counter):
    """(offset, error): this rank's `clock` minus global rank 0's, in seconds. Collective (world).

    Ranks 1, 2, ... take turns pinging rank 0 `rounds` times: the rank reads its clock (a), sends,
    rank 0 answers with its own clock read on receipt (t0), the rank reads its clock again (b). t0 was
    read between a and b, so the offset lies in [a - t0, b - t0]: the midpoint is taken, wrong by at
    most (b - a) / 2; the round with the shortest round trip is kept. The exchange is between host
    clocks over gloo (a gloo group is made when the default backend is another), so no device queue
    sits between a clock read and a message. Drift over the seconds since the profiled step is ignored.
    """
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    best = (0.0, 0.0)
    message = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        for peer in range(1, world):
            for _ in range(rounds):
                dist.recv(message, src=peer, group=group)
                message[0] = clock()
                dist.send(message, dst=peer, group=group)
    else:
        best = (0.0, float("inf"))
        for _ in range(rounds):
            before = clock()
            dist.send(message, dst=0, group=group)
            dist.recv(message, src=0, group=group)
            after = clock()
            error = (after - before) / 2
            if error < best[1]:
                best = ((before + after) / 2 - message.item(), error)
    if group is not None:
        dist.destroy_process_group(group)
    return best


def _coordinates(engine):
    if isinstance(engine, PipelineEngine):
        grid = engine.grid
        return grid.get_stage_id(), grid.get_slice_parallel_rank(), grid.get_data_parallel_rank()
    mpu = engine.mpu
    tp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
    dp_rank = mpu.get_data_parallel_rank() if mpu is not None else dist.get_rank()
    return 0, tp_rank, dp_rank


def _parallel_sizes(engine):
    if isinstance(engine, PipelineEngine):
        grid = engine.grid
        return (grid.get_pipe_parallel_world_size(), grid.get_slice_parallel_world_size(),
                grid.get_data_parallel_world_size())
    mpu = engine.mpu
    tp = mpu.get_model_parallel_world_size() if mpu is not None else 1
    return 1, tp, dist.get_world_size() // tp


def _annotate_replicated_params(module, node):
    """replicated_params: the part of a node's params that every tensor rank holds whole.

    Parameters marked tensor_model_parallel are shards (summed over tensor ranks); the rest
    (LayerNorm, row-parallel biases, position embeddings) are counted once.
    """
    seen = set()

    def visit(mod, tree_node):
        own = 0
        for param in mod.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                if not getattr(param, "tensor_model_parallel", False):
                    own += param.numel()
        children = dict(mod.named_children())
        total = own
        for child_node in tree_node["children"]:
            child = children.get(child_node["name"])
            if child is not None:
                total += visit(child, child_node)
        tree_node["replicated_params"] = total
        return total

    visit(module, node)


def _unpatched(method):
    """patches wraps the engines' train_batch, forward and step; the profiler itself runs the originals."""
    return getattr(method, "__wrapped__", method)


def _with_unit(text, unit):
    return f"{text}{unit}" if text[-1].isalpha() else f"{text} {unit}"


def _plain(kwargs):
    return {key: value for key, value in kwargs.items() if isinstance(value, (int, float, str, bool))}
