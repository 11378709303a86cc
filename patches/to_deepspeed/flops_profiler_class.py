"""Make DeepSpeed's own `FlopsProfiler` class, the one its documentation teaches, true for a PipelineEngine.

What DeepSpeed does: `FlopsProfiler(model[0])` (a PipelineEngine, or its PipelineModule) hooks the
forward of the calling rank's stage only: no backward, one stage's params as the model's, recompute
counted as forward, children timed above their parents (every recomputed forward is timed again), and
the ranks that never call end_profile() keep its patched torch.nn.functional for the rest of the run.

What this patch changes: `FlopsProfiler(x)` with x a PipelineEngine (or a PipelineModule built into
one) returns a UserCodeFlopsProfiler, an instance of FlopsProfiler with its whole API, which profiles
every stage that started through the next train_batch and reports the whole pipeline on any rank
(profiler/user_code_profiler.py). Any other model (a plain module, a plain engine) gets DeepSpeed's
FlopsProfiler, unchanged; so does get_model_profile.
"""
import weakref

from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler

from patches.process import store
from patches.process.registry import REGISTRY, pipeline_engine_of
from patches.profiler.attachment import EngineAttachment
from patches.profiler.user_code_profiler import UserCodeFlopsProfiler

WHAT_IT_FIXES = "FlopsProfiler(model[0]) on a PipelineEngine"


def requires():
    return [(FlopsProfiler, name) for name in ("start_profile", "stop_profile", "end_profile", "print_model_profile",
                                               "print_model_aggregated_profile", "get_total_flops")] + \
        store.requires()


def install():
    FlopsProfiler.__new__ = staticmethod(_pipeline_aware_new)


def engine_built(engine, attachment: EngineAttachment):
    """A PipelineEngine's module is known to be its own (FlopsProfiler(model[0].module) profiles the engine)."""
    if attachment.runs_a_schedule:
        REGISTRY.engine_of_module[engine.module] = weakref.ref(engine)  # weakly: the engine holds its module


def _pipeline_aware_new(cls, model=None, ds_engine=None, *args, **kwargs):
    """FlopsProfiler(model, ds_engine=None, recompute_fwd_factor=0.0): the pipeline-aware profiler where
    model (or ds_engine) is a PipelineEngine; Python then runs its __init__ with the same arguments."""
    if cls is FlopsProfiler and pipeline_engine_of(model, ds_engine) is not None:
        return object.__new__(UserCodeFlopsProfiler)
    return object.__new__(cls)
