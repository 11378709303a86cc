"""What the patch set keeps for the whole process, in one place: its only module-level state.

- which patches are applied (patches.apply() and the Megatron patches run once);
- what the Megatron flags set for every pipeline of the run (--pp-partition-from-profile, --no-load-optim,
  --pp-recompute-layers);
- how many engines and PipelineModules this process built: every rank builds them in the same order, so the
  n-th one's keys in the process group's store name the same object on every rank;
- which PipelineEngine a PipelineModule belongs to, for FlopsProfiler(model[0].module);
- every engine's attachment, weakly, for the teardown at exit (clean_exit.py) to let go of its report groups.

Everything the profiler keeps about one engine lives on that engine (profiler/attachment.py), not here.
"""
import weakref
from dataclasses import dataclass, field
from typing import Optional, Tuple

from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule


@dataclass
class RunSettings:
    """What the Megatron flags ask of every pipeline this process builds (megatron_flags.py)."""
    partition_report: Optional[str] = None  # --pp-partition-from-profile: cut every PipelineModule by this report
    partition_memory_limit: Optional[int] = None  # --pp-partition-memory-limit: plan under it (bytes)
    drop_optimizer_state_across_partitions: bool = False  # --no-load-optim: resume across partitions without it
    # --pp-recompute-layers: stage s of every PipelineModule recomputes the first K_s of its checkpointable layers
    recompute_layers: Optional[Tuple[int, ...]] = None


@dataclass
class Registry:
    applied: bool = False  # patches.apply() ran
    megatron_patched: bool = False  # patches.to_megatron.megatron_upstream.install() ran
    # what the flags ask of every pipeline this process builds from now on (megatron_flags.take_profiler_flags)
    settings: RunSettings = field(default_factory=RunSettings)
    engines_built: int = 0
    pipeline_modules_built: int = 0
    # PipelineModule -> weak reference to its PipelineEngine (weak both ways: an engine holds its module), set by
    # flops_profiler_class.engine_built
    engine_of_module: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    attachments: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # profiler/attachment.EngineAttachment


REGISTRY = Registry()


def pipeline_engine_of(model: object, ds_engine: object = None) -> Optional[PipelineEngine]:
    """The PipelineEngine that FlopsProfiler(model, ds_engine) profiles, or None (a plain module or engine)."""
    for candidate in (model, ds_engine):
        if isinstance(candidate, PipelineEngine):
            return candidate
        if isinstance(candidate, PipelineModule) and candidate in REGISTRY.engine_of_module:
            return REGISTRY.engine_of_module[candidate]()
    return None
