"""Per-stage activation recompute on DeepSpeed's PipelineModule (patches/partition/recompute.py says which layers):
where --pp-recompute-layers or $DS_PIPE_RECOMPUTE_LAYERS names a count per stage, or the profile's plan that cut
the module chose one (partition_method.py: `planned_recompute`), each PipelineModule built afterwards checkpoints,
on its stage, each of the first K_s layers DeepSpeed would checkpoint, alone (its activation_checkpoint_interval
becomes 1), through its own activation_checkpoint_func (DeepSpeed's checkpoint and its `activation_checkpointing`
config by default). DeepSpeed has one interval for every stage.

The module records what it does, for code that holds it: `recomputed_layers` (the indices, in the whole layer list,
of its stage's layers that recompute) and `recompute_asked` (K_s). The report reads what ran from the layers'
recompute FLOPs.
"""
import functools

from deepspeed.runtime.pipe.module import PipelineModule

from patches.partition.recompute import first_layers, recompute_layers, stage_count

WHAT_IT_FIXES = "per-stage activation recompute (--pp-recompute-layers)"


def requires():
    return [(PipelineModule, "__init__"), (PipelineModule, "_is_checkpointable"), (PipelineModule, "forward")]


def install():
    original_init, original_is_checkpointable = PipelineModule.__init__, PipelineModule._is_checkpointable

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        counts, source = getattr(self, "planned_recompute", None), "the profile's plan"
        if counts is None:
            counts, source = recompute_layers()
        if counts is None:
            return
        asked = stage_count(counts, self.num_stages, self.stage_id, source)
        able = [bool(original_is_checkpointable(self, [layer])) for layer in self.forward_funcs]
        chosen = first_layers(able, asked)
        self.recompute_asked = asked
        self.recomputed_layers = [self._local_start + index for index in chosen]
        self._recomputed = {id(self.forward_funcs[index]) for index in chosen}
        # DeepSpeed >= 0.16 reads _is_checkpointable once per interval, when the engine is built; older ones on
        # every forward
        self.activation_checkpoint_interval = 1 if chosen else 0

    @functools.wraps(original_is_checkpointable)
    def _is_checkpointable(self, funcs):
        recomputed = getattr(self, "_recomputed", None)
        if recomputed is None:
            return original_is_checkpointable(self, funcs)
        return all(id(layer) in recomputed for layer in funcs)

    PipelineModule.__init__ = __init__
    PipelineModule._is_checkpointable = _is_checkpointable
