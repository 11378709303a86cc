"""The patch set: version-checked runtime patches to DeepSpeed and to Megatron-DeepSpeed, and the profiler.

It imports nothing from any `megatron` package: our GPT fork and a user's own Megatron-DeepSpeed are its users.

`patches.apply()` is idempotent. It refuses, with a message naming both versions, to patch a
DeepSpeed it was not written against: the patched methods are private and change between releases.
"""
import deepspeed

SUPPORTED_DEEPSPEED = ("0.19.",)

_applied = False


class UnsupportedDeepSpeedVersion(RuntimeError):
    pass


def check_version(version=None, targets=SUPPORTED_DEEPSPEED):
    version = version or deepspeed.__version__
    if not version.startswith(targets):
        raise UnsupportedDeepSpeedVersion(
            f"patches were written for DeepSpeed {', '.join(v + 'x' for v in targets)}; "
            f"found {version}. The pipeline FLOPs profiler's config integration is not applied.")


def apply():
    global _applied
    if _applied:
        return
    check_version()
    from patches import flops_profiler_config, pipeline_timers, section_timers
    for patch in (section_timers, flops_profiler_config, pipeline_timers):
        check_version(targets=patch.TARGETS)
        patch.install()
    _applied = True
