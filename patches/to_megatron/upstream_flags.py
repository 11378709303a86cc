"""Upstream Megatron-DeepSpeed's parse_args with the profiler's flags: added to its parser, checked once parsed
(one line and exit 2 on a bad one), and what they set for every pipeline of the run (the partition from a profile,
the memory limit, the layers each stage recomputes, optimizer state across partitions)."""
import functools
from argparse import Namespace
from typing import Callable

from patches.process.errors import PatchConfigError, exit_with_one_line
from patches.to_megatron.megatron_flags import (
    PROFILE_STEP_FLAG,
    add_profiler_flags,
    take_profiler_flags,
)


def check_upstream_profiler_flags(args: Namespace) -> None:
    """Raise PatchConfigError on a --profile-flops-step that could never run or report in upstream's run; else
    take the flags (take_profiler_flags), --pp-partition-from-profile cutting every pipeline (it overrides
    GPTModelPipe's hard-coded partition_method)."""
    if args.profile_flops_step is not None and not getattr(args, "deepspeed", False):
        raise PatchConfigError(f"{PROFILE_STEP_FLAG} profiles a DeepSpeed engine: add --deepspeed")
    pipeline = getattr(args, "deepspeed", False) and not getattr(args, "no_pipeline_parallel", False)
    take_profiler_flags(args, on_deepspeeds_pipeline=pipeline, partition_report=args.pp_partition_from_profile)


def parse_args_with_profiler_flags(original: Callable) -> Callable:
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, *args, **kwargs):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            add_profiler_flags(parser)
            return parser

        parsed = original(provider, *args, **kwargs)
        try:
            check_upstream_profiler_flags(parsed)
        except PatchConfigError as error:
            exit_with_one_line(str(error))
        return parsed

    return parse_args
