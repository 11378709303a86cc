"""Which PipelineEngine a PipelineModule belongs to, and each engine's ordinal in this process.

Filled by the FlopsProfiler patch (flops_profiler_class.py) as PipelineEngines are built; read by it, to tell a
pipeline from a plain module, and by the store-based reports (profiler/sources.py), to name one engine alike on
every rank (engines are built in the same order on every rank, so the ordinal names the same engine everywhere).
"""
import weakref
from typing import Optional, Union

from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

# Weak both ways: an engine holds its module, so a strong value would keep its own key (and itself) alive.
_ENGINE_OF_MODULE = weakref.WeakKeyDictionary()  # PipelineModule -> weakref to its PipelineEngine
_ORDINAL_OF_ENGINE = weakref.WeakKeyDictionary()
_REGISTERED = [0]  # engines registered so far in this process (an ordinal is never reused)


def register(engine: PipelineEngine) -> None:
    _ENGINE_OF_MODULE[engine.module] = weakref.ref(engine)
    _ORDINAL_OF_ENGINE[engine] = _REGISTERED[0]
    _REGISTERED[0] += 1


def engine_ordinal(engine: PipelineEngine) -> Union[int, str]:
    """The engine's ordinal in this process ('unregistered' for one built before patches.apply())."""
    return _ORDINAL_OF_ENGINE.get(engine, "unregistered")


def pipeline_engine_of(model: object, ds_engine: object = None) -> Optional[PipelineEngine]:
    """The PipelineEngine that FlopsProfiler(model, ds_engine) profiles, or None (a plain module or engine)."""
    for candidate in (model, ds_engine):
        if isinstance(candidate, PipelineEngine):
            return candidate
        if isinstance(candidate, PipelineModule) and candidate in _ENGINE_OF_MODULE:
            return _ENGINE_OF_MODULE[candidate]()
    return None
