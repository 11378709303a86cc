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
import functools
import weakref
from typing import Optional, Union

from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from patches.profiler import store_exchange

WHAT_IT_FIXES = "FlopsProfiler(model[0]) on a PipelineEngine"


def requires():
    return [(FlopsProfiler, name) for name in ("start_profile", "stop_profile", "end_profile", "print_model_profile",
                                               "print_model_aggregated_profile", "get_total_flops")] + \
        [(PipelineEngine, "__init__")] + store_exchange.requires()


def install():
    PipelineEngine.__init__ = _registering_init(PipelineEngine.__init__)
    FlopsProfiler.__new__ = staticmethod(_pipeline_aware_new)


# PipelineModule -> its PipelineEngine, and each PipelineEngine's ordinal: engines are built in the same
# order on every rank, so the ordinal names one engine on all of them (in the profiler's store keys).
_ENGINE_OF_MODULE = weakref.WeakKeyDictionary()
_ORDINAL_OF_ENGINE = weakref.WeakKeyDictionary()


def _registering_init(original_init):
    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _ENGINE_OF_MODULE[self.module] = self
        _ORDINAL_OF_ENGINE[self] = len(_ORDINAL_OF_ENGINE)

    return __init__


def engine_ordinal(engine: PipelineEngine) -> Union[int, str]:
    """The engine's ordinal in this process ('unregistered' for one built before patches.apply())."""
    return _ORDINAL_OF_ENGINE.get(engine, "unregistered")


def pipeline_engine_of(model, ds_engine=None) -> Optional[PipelineEngine]:
    """The PipelineEngine that FlopsProfiler(model, ds_engine) profiles, or None (a plain module or engine)."""
    for candidate in (model, ds_engine):
        if isinstance(candidate, PipelineEngine):
            return candidate
        if isinstance(candidate, PipelineModule) and candidate in _ENGINE_OF_MODULE:
            return _ENGINE_OF_MODULE[candidate]
    return None


def _pipeline_aware_new(cls, model=None, ds_engine=None, *args, **kwargs):
    """FlopsProfiler(model, ds_engine=None, recompute_fwd_factor=0.0): the pipeline-aware profiler where
    model (or ds_engine) is a PipelineEngine; Python then runs its __init__ with the same arguments."""
    if cls is FlopsProfiler:
        if pipeline_engine_of(model, ds_engine) is not None:
            from patches.profiler.user_code_profiler import UserCodeFlopsProfiler
            return object.__new__(UserCodeFlopsProfiler)
    return object.__new__(cls)
