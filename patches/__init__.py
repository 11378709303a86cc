"""The patch set: version-checked runtime patches to DeepSpeed and to Megatron-DeepSpeed, and the profiler.

It imports nothing from any `megatron` package: our GPT fork and a user's own Megatron-DeepSpeed are its users.

`patches.apply()` is idempotent. The DeepSpeed patches replace private methods, which change between
releases: each patch names the DeepSpeed attributes it needs (requires()), and a patch whose attributes
are missing is not applied, with one line naming them (nothing is half-patched). A DeepSpeed release the
project was not tested with gets one warning line; it is not refused.

A patch changes DeepSpeed's classes in its install(), and acts on each engine built afterwards in its
engine_built(engine, attachment), which apply() hands to the one wrapper of the engines' __init__ (engine_methods.py).
"""
import os
import sys
from typing import List, Optional

# Tested with these (the README's table): the patches' own tests and the upstream Megatron-DeepSpeed tier.
TESTED_DEEPSPEED = ("0.19.8", "0.19.6", "0.18.9", "0.16.9", "0.14.5")


def _say(line: str) -> None:
    """One line on global rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)


def untested_version_warning(version: str) -> str:
    return (f"warning: patches: DeepSpeed {version} is not among the tested versions "
            f"({', '.join(TESTED_DEEPSPEED)}); every patch still checks the DeepSpeed attributes it needs")


def missing_attributes(requires) -> List[str]:
    """The 'owner.attribute' names of `requires` ((owner, attribute) pairs) that this DeepSpeed lacks."""
    return [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in requires if not hasattr(owner, name)]


def apply_to_this_run(argv: Optional[List[str]] = None) -> None:
    """apply(), and the patches to the Megatron-DeepSpeed this process imports (patches.to_megatron.megatron_upstream):
    what `python -m patches.launch` does, as one line at the top of a user's own pretrain_gpt.py.
    argv: the script's arguments (default sys.argv[1:]), to know whether --profile-flops-step is asked for."""
    apply()
    from patches.to_megatron import megatron_upstream

    megatron_upstream.install(sys.argv[1:] if argv is None else argv)


def apply() -> None:
    from patches.process.registry import REGISTRY

    if REGISTRY.applied:
        return
    import deepspeed

    if deepspeed.__version__ not in TESTED_DEEPSPEED:
        _say(untested_version_warning(deepspeed.__version__))
    from patches.partition import method as partition_method
    from patches.to_deepspeed import (
        engine_methods,
        flops_profiler_class,
        flops_profiler_config,
        pipeline_checkpoint,
        pipeline_timers,
        section_timers,
        zero_pipeline_groups,
    )

    def missing_from(patch) -> bool:
        missing = missing_attributes(patch.requires())
        if missing:
            _say(f"warning: patches: {patch.__name__} is not applied: DeepSpeed {deepspeed.__version__} has no "
                 f"{', '.join(missing)} ({patch.WHAT_IT_FIXES} stays as DeepSpeed has it)")
        return bool(missing)

    REGISTRY.applied = True
    if missing_from(engine_methods):  # every other patch acts through the engines' wrappers
        return
    applied = [patch for patch in (section_timers, flops_profiler_config, pipeline_timers, flops_profiler_class,
                                   partition_method, pipeline_checkpoint, zero_pipeline_groups)
               if not missing_from(patch)]
    for patch in applied:
        if hasattr(patch, "install"):
            patch.install()
    engine_methods.install(when_built=[patch.engine_built for patch in applied if hasattr(patch, "engine_built")],
                           during_init=[flops_profiler_config.true_start_up_line]
                           if flops_profiler_config in applied else [])
