"""What DeepSpeed gets: one file per patch, each naming the DeepSpeed attributes it needs (`requires()`) and the gap
it closes (`WHAT_IT_FIXES`); `install()` applies every patch this DeepSpeed has the attributes for.

A patch changes DeepSpeed's classes in its install(), and acts on each engine built afterwards in its
engine_built(engine, attachment), which install() hands to the one wrapper of the engines' __init__ (engine_methods.py).
"""
import os
import sys
from typing import List


def say_on_rank_0(line: str) -> None:
    """One line on global rank 0 only (before or after the process group exists)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)


def missing_attributes(requires) -> List[str]:
    """The 'owner.attribute' names of `requires` ((owner, attribute) pairs) that this DeepSpeed lacks."""
    return [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in requires if not hasattr(owner, name)]


def install() -> None:
    """Every patch whose DeepSpeed attributes are all here; each one missing some is not applied, in one line naming
    them (nothing is half-patched). Without the engine methods' wrappers, none is."""
    import deepspeed

    from patches.to_deepspeed import (
        engine_methods,
        flops_profiler_class,
        flops_profiler_config,
        partition_method,
        pipeline_checkpoint,
        pipeline_timers,
        section_timers,
        stage_recompute,
        zero_pipeline_groups,
    )

    def missing_from(patch) -> bool:
        missing = missing_attributes(patch.requires())
        if missing:
            say_on_rank_0(f"warning: patches: {patch.__name__} is not applied: DeepSpeed {deepspeed.__version__} has "
                          f"no {', '.join(missing)} ({patch.WHAT_IT_FIXES} stays as DeepSpeed has it)")
        return bool(missing)

    if missing_from(engine_methods):  # every other patch acts through the engines' wrappers
        return
    applied = [patch for patch in (section_timers, flops_profiler_config, pipeline_timers, flops_profiler_class,
                                   partition_method, stage_recompute, pipeline_checkpoint, zero_pipeline_groups)
               if not missing_from(patch)]
    for patch in applied:
        if hasattr(patch, "install"):
            patch.install()
    engine_methods.install(when_built=[patch.engine_built for patch in applied if hasattr(patch, "engine_built")],
                           during_init=[flops_profiler_config.true_start_up_line]
                           if flops_profiler_config in applied else [])
