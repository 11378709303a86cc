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
    take_profiler_flags(args, partition_report=args.pp_partition_from_profile)


def block_recompute_on_the_pipeline(args: Namespace) -> None:
    """Megatron-LM's --recompute-granularity full --recompute-method block --recompute-num-layers N, which upstream's
    GPTModelPipe leaves undone on DeepSpeed's pipeline ("deepspeed's pipeline doesn't support the block recompute
    method"): the first N transformer layers of every stage recompute, as --pp-recompute-layers N,N,... says."""
    pipeline = not getattr(args, "no_pipeline_parallel", False) and getattr(args, "deepspeed", False)
    if (pipeline and getattr(args, "pp_recompute_layers", None) is None
            and getattr(args, "recompute_granularity", None) == "full"
            and getattr(args, "recompute_method", None) == "block"):
        args.pp_recompute_layers = (args.recompute_num_layers,) * args.pipeline_model_parallel_size


def parse_args_with_profiler_flags(original: Callable) -> Callable:
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, *args, **kwargs):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            add_profiler_flags(parser)
            return parser

        parsed = original(provider, *args, **kwargs)
        block_recompute_on_the_pipeline(parsed)
        try:
            check_upstream_profiler_flags(parsed)
        except PatchConfigError as error:
            exit_with_one_line(str(error))
        return parsed

    return parse_args
