"""The patch set: version-checked runtime patches to DeepSpeed and to Megatron-DeepSpeed, and the profiler.

It imports nothing from any `megatron` package: our GPT fork and a user's own Megatron-DeepSpeed are its users.

`patches.apply()` is idempotent. The DeepSpeed patches replace private methods, which change between
releases: each patch names the DeepSpeed attributes it needs (requires()), and a patch whose attributes
are missing is not applied, with one line naming them (nothing is half-patched: `to_deepspeed.install()`).
A DeepSpeed release the project was not tested with gets one warning line; it is not refused.
"""
import sys
from typing import List, Optional

# Tested with these (the README's table): the patches' own tests and the upstream Megatron-DeepSpeed tier.
TESTED_DEEPSPEED = ("0.19.8", "0.19.6", "0.18.9", "0.16.9", "0.14.5")


def untested_version_warning(version: str) -> str:
    return (f"warning: patches: DeepSpeed {version} is not among the tested versions "
            f"({', '.join(TESTED_DEEPSPEED)}); every patch still checks the DeepSpeed attributes it needs")


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

    from patches import to_deepspeed

    if deepspeed.__version__ not in TESTED_DEEPSPEED:
        to_deepspeed.say_on_rank_0(untested_version_warning(deepspeed.__version__))
    REGISTRY.applied = True
    to_deepspeed.install()
