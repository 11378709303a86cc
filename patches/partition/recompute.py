"""Which layers each pipeline stage recomputes: stage s recomputes the first K_s of its checkpointable layers (a
transformer layer in a GPT; DeepSpeed's own rule elsewhere, PipelineModule._is_checkpointable), each layer its own
checkpoint, through DeepSpeed's checkpoint function.

    --pp-recompute-layers 3,1,0          # Megatron (ours and upstream's, megatron_flags.py): K_s per stage
    DS_PIPE_RECOMPUTE_LAYERS=3,1,0       # a plain PipelineModule: the same, for every one this process builds

Why per stage: under 1F1B stage s holds min(pp - s, micro-batches) micro-batches of activations, so stage 0 needs
recompute most and the last stage hardly at all, while every tool gives one number for all stages. Why the first
K_s: Megatron-LM's --recompute-method block recomputes the first N layers of each stage; this is that, with N per
stage (--recompute-method block --recompute-num-layers N is K_s = N on every stage). A stage holding fewer
checkpointable layers than K_s recomputes all it holds, and says so (numbers that happened).
"""
import os
from typing import List, Optional, Sequence, Tuple

from patches.process.errors import PatchConfigError

ENVIRONMENT = "DS_PIPE_RECOMPUTE_LAYERS"
FLAG = "--pp-recompute-layers"


def parse_recompute_layers(text: str, what: str = FLAG) -> Tuple[int, ...]:
    """'3,1,0' -> (3, 1, 0): one count of layers per stage, none negative. PatchConfigError, one line, otherwise."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise PatchConfigError(f"{what} {text!r}: give one count of layers per pipeline stage, e.g. 3,1,0") from None
    if any(count < 0 for count in counts):
        raise PatchConfigError(f"{what} {text!r}: a stage cannot recompute a negative number of layers")
    return counts


def recompute_layers() -> Tuple[Optional[Tuple[int, ...]], Optional[str]]:
    """(counts per stage, where they came from: the flag or $DS_PIPE_RECOMPUTE_LAYERS), or (None, None)."""
    from patches.process.registry import REGISTRY

    if REGISTRY.settings.recompute_layers is not None:
        return REGISTRY.settings.recompute_layers, FLAG
    text = os.environ.get(ENVIRONMENT)
    if text:
        return parse_recompute_layers(text, f"${ENVIRONMENT}"), f"${ENVIRONMENT}"
    return None, None


def stage_count(counts: Sequence[int], stages: int, stage: int, source: str) -> int:
    """counts[stage], where counts names every one of `stages` stages; PatchConfigError, one line, otherwise."""
    if len(counts) != stages:
        raise PatchConfigError(f"{source} {','.join(map(str, counts))} names {len(counts)} pipeline stages; "
                               f"the pipeline has {stages}")
    return counts[stage]


def first_layers(checkpointable: List[bool], count: int) -> List[int]:
    """The local indices of the first `count` layers marked checkpointable (all of them, where fewer are)."""
    return [index for index, able in enumerate(checkpointable) if able][:count]
