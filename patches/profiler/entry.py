"""One rank's record of the profiled iteration: what it measured, as the report builder and the trace read it."""
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from patches.profiler.engine_hooks import InstructionTimer
from patches.profiler.layers import stage_layers
from patches.profiler.layout import EngineLayout
from patches.profiler.module_profiler import ModuleProfiler


@dataclass
class RankEntry:
    """One rank's measurements, as build_report and build_trace read them (as_dict)."""
    global_rank: int
    stage_id: int
    tp_rank: int
    dp_rank: int
    modules: dict
    instructions: dict
    train_batch_latency_s: float
    peak_memory_bytes: Optional[int]
    events: list
    uncounted_ops: list = field(default_factory=list)  # ModuleProfiler.uncounted_ops() as dicts
    counted_iteration: Optional[int] = None  # where the FLOPs were counted when not in the profiled iteration
    calls_differ: list = field(default_factory=list)  # ModuleProfiler.adopt_counts(): calls unlike the counted ones
    schedule: Optional[str] = None  # the pipeline schedule's class (EngineHooks.schedule); None on a plain engine
    invisible_attention: list = field(default_factory=list)  # ModuleProfiler.invisible_attention()
    layers: Optional[list] = None  # layers.stage_layers(): this stage's layers of a PipelineModule, else None
    parts: Optional[list] = None  # the PipelineModule's stage boundaries (PipelineModule.parts)
    clock_offset_s: float = 0.0
    clock_error_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def build_rank_entry(layout: EngineLayout, module: torch.nn.Module, module_profiler: ModuleProfiler,
                     instructions: InstructionTimer, train_batch_s: float,
                     peak_memory_bytes: Optional[int], counted_iteration: Optional[int] = None,
                     calls_differ: Optional[List[str]] = None, schedule: Optional[str] = None) -> RankEntry:
    """This rank's measurements, from its stopped module profiler and instruction timer."""
    tree = module_profiler.tree()
    _annotate_replicated_params(module, tree)
    events = [(name, _plain(kwargs), start, end) for name, kwargs, start, end in instructions.events]
    uncounted = [asdict(op) for op in module_profiler.uncounted_ops()]
    return RankEntry(dist.get_rank(), layout.stage, layout.tp_rank, layout.dp_rank, tree, instructions.as_dict(),
                     train_batch_s, peak_memory_bytes, events, uncounted, counted_iteration, list(calls_differ or []),
                     schedule, module_profiler.invisible_attention(), stage_layers(module, layout.stage),
                     [int(part) for part in getattr(module, "parts", None) or []] or None)


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


def _plain(kwargs):
    return {key: value for key, value in kwargs.items() if isinstance(value, (int, float, str, bool))}
