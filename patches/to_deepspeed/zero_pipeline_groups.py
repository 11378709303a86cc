"""ZeRO stage 1 on a PipelineEngine whose stages hold different numbers of optimizer parameter groups: refused in
one line when the engine is built, instead of a hang in its first optimizer step.

What DeepSpeed does: it drops an optimizer parameter group that has no parameters (DeepSpeedEngine's
optimizer set-up), and ZeRO's gradient norm all-reduces once per group over its model-parallel group, which
on a pipeline spans the stages. A stage whose parameters all fall in one group (with Megatron's two, matrices
with weight decay and biases and norms without: an embedding or an LM head alone on its stage) makes one
all-reduce where the other stages make two: the first step hangs. Any partition can do it; a plan that gives
the LM head a stage of its own (partition/method.py) often does.

The check: once the engine is built, every rank publishes its number of groups under its own key of the
default group's store and reads every other rank's (no collective: a rank that fails here leaves no one inside
one). Equal everywhere: nothing else happens. Unequal: PatchConfigError on every rank, naming the stages.
"""
from typing import Dict, Optional

import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from patches.process import store
from patches.process.errors import PatchConfigError
from patches.profiler.attachment import EngineAttachment

WHAT_IT_FIXES = "ZeRO stage 1 on pipeline stages with unequal optimizer parameter groups (a hang)"


def requires():
    return [(PipelineEngine, "__init__"), *store.requires()]


def engine_built(engine, attachment: EngineAttachment):
    """Once a PipelineEngine is built: its stages' optimizer groups compared (the engine's ordinal names it alike
    on every rank, which build their engines in the same order)."""
    groups = getattr(engine.optimizer, "bit16_groups", None)  # set by ZeRO's __init__, one list a group
    if attachment.runs_a_schedule and isinstance(engine.optimizer, DeepSpeedZeroOptimizer) and groups is not None \
            and dist.is_initialized():
        check_equal_groups(f"engine{attachment.ordinal}", engine.stage_id, len(groups),
                           engine.zero_optimization_stage())


def check_equal_groups(name: str, stage: int, groups: int, zero_stage: int) -> None:
    """Every rank of the world: publish (stage, groups), read everyone's, refuse unequal counts in one line."""
    by_stage: Dict[int, int] = {}
    for other_stage, other_groups in store.every_ranks(f"zero_pipeline_groups/{name}", (stage, groups)):
        by_stage.setdefault(other_stage, other_groups)
    message = unequal_groups_message(by_stage, zero_stage)
    if message is not None:
        raise PatchConfigError(message)


def unequal_groups_message(groups_by_stage: Dict[int, int], zero_stage: int) -> Optional[str]:
    counts = sorted(set(groups_by_stage.values()))
    if len(counts) < 2:
        return None
    described = ", ".join(f"stage {stage} {groups}" for stage, groups in sorted(groups_by_stage.items()))
    return (f"ZeRO stage {zero_stage} on this pipeline would hang in its first step: its stages hold unequal "
            f"numbers of optimizer parameter groups ({described}; DeepSpeed drops an empty group, and ZeRO "
            "all-reduces each group's gradient norm across the stages). Cut the layers so that every stage has "
            "parameters of every group (e.g. not an embedding or an LM head alone), or run without ZeRO")
