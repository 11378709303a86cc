"""The profiler's flags for a Megatron argument parser, defined once: our GPT fork's parser and upstream
Megatron-DeepSpeed's (through patches.to_megatron.megatron_upstream) both add them here and check them here.

    --profile-flops-step N       profile iteration N on every stage and print one gathered report
    --profile-flops-output DIR   where flops_profile_stepN.json and pipeline_trace_stepN.json go
    --profile-flops-counting     where N's FLOPs are counted: in N-1 (default) or in N itself
    --pp-partition-from-profile REPORT.json
                                 cut the pipeline where a profiled run's measured layers say (partition/method.py)
    --pp-partition-memory-limit SIZE
                                 plan (that cut, and the report's plan) with every stage's predicted memory peak
                                 within SIZE (80GB, 70GiB, bytes); default: the device's memory, none on CPU
    --pp-recompute-layers K0,K1,...
                                 stage s recomputes the first K_s of its transformer layers (partition/recompute.py)
"""
import os
import tempfile
from argparse import ArgumentParser, Namespace
from typing import Any, Optional

from patches.partition.recompute import FLAG as RECOMPUTE_FLAG
from patches.partition.recompute import parse_recompute_layers
from patches.process.errors import PatchConfigError
from patches.profiler.one_step import COUNT_IN_PREVIOUS, COUNTING_CHOICES

PROFILE_STEP_FLAG = "--profile-flops-step"
MEMORY_LIMIT_FLAG = "--pp-partition-memory-limit"
COUNTING_HELP = ("where --profile-flops-step counts FLOPs: 'previous' (default): in the iteration before, with a "
                 "dispatch mode, so that the profiled iteration runs without one (its module calls are checked "
                 "against the counted ones); 'profiled': in the profiled iteration itself (for a model whose "
                 "iterations differ in shape; the profiled iteration runs slower)")


def add_profiler_flags(parser: ArgumentParser) -> Any:
    """Add the flags to `parser` in their own group; returns the group (a Megatron may add its own to it)."""
    group = parser.add_argument_group("FLOPs profiler (patches)")
    group.add_argument(PROFILE_STEP_FLAG, type=int, default=None,
                       help="profile this iteration on every pipeline stage and print one gathered report")
    group.add_argument("--profile-flops-output", default=".",
                       help="directory for flops_profile_step{N}.json and pipeline_trace_step{N}.json "
                            "(default: the working directory)")
    group.add_argument("--profile-flops-counting", choices=COUNTING_CHOICES, default=COUNT_IN_PREVIOUS,
                       help=COUNTING_HELP)
    group.add_argument("--pp-partition-from-profile", default=None, metavar="REPORT.json",
                       help="cut the pipeline's layers where this profile report (flops_profile_stepN.json of a run "
                            "of the same model) measured them: contiguous, no stage empty, the slowest stage as fast "
                            "as it can be (DeepSpeed's partition_method='profile')")
    group.add_argument(MEMORY_LIMIT_FLAG, default=None, metavar="SIZE",
                       help="plan the partition (--pp-partition-from-profile's, and the profile report's plan) with "
                            "every stage's predicted memory peak within SIZE: bytes, or with KB, MB, GB, TB or KiB, "
                            "MiB, GiB, TiB (e.g. 80GB, 70GiB); default: the device's memory (none on CPU)")
    group.add_argument(RECOMPUTE_FLAG, default=None, metavar="K0,K1,...",
                       help="activation recompute per pipeline stage: stage s recomputes the first K_s of its "
                            "transformer layers, each its own checkpoint (DeepSpeed's checkpoint function and "
                            "activation_checkpointing config); instead of --checkpoint-activations")
    return group


def memory_limit_of(args: Namespace) -> Optional[int]:
    """--pp-partition-memory-limit in bytes (None: not given). PatchConfigError, one line, for a bad size."""
    text = getattr(args, "pp_partition_memory_limit", None)
    if text is None:
        return None
    from patches.formats.units import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise PatchConfigError(f"{MEMORY_LIMIT_FLAG} {text}: {error}") from None


def check_profiler_flags(args: Namespace) -> None:
    """Raise PatchConfigError on a --profile-flops-step that could never run or report, or a partition report that
    cannot be planned from (or not under the memory limit given). A Megatron adds its own checks (what its training
    loop can end on) after these."""
    check_recompute_flag(args)
    limit = memory_limit_of(args)
    report = getattr(args, "pp_partition_from_profile", None)
    if report is not None:
        from patches.partition.memory_model import memory_terms_of
        from patches.partition.report_file import read_report

        content = read_report(report)
        if not content.get("layers"):
            raise PatchConfigError(f"--pp-partition-from-profile {report}: the report has no layer table (a "
                                   "PipelineModule's run profiled by this profiler has one)")
        if limit is not None and memory_terms_of(content) is None:
            raise PatchConfigError(f"{MEMORY_LIMIT_FLAG} {args.pp_partition_memory_limit} cannot be honoured: the "
                                   f"profile report {report} has no memory terms (each stage's memory and each "
                                   "layer's state and activation bytes, which this profiler measures on a pipeline "
                                   "run)")
    step = args.profile_flops_step
    if step is None:
        return
    if step < 1:
        raise PatchConfigError(f"{PROFILE_STEP_FLAG} {step} must be >= 1")
    train_iters = getattr(args, "train_iters", None)
    if train_iters is not None and step > train_iters:
        raise PatchConfigError(f"{PROFILE_STEP_FLAG} {step} is beyond --train-iters {train_iters}")
    output = args.profile_flops_output
    problem = unwritable_directory(output)
    if problem is not None:
        raise PatchConfigError(f"--profile-flops-output {output} is not a writable directory ({problem})")


def check_recompute_flag(args: Namespace) -> None:
    """--pp-recompute-layers: one count per pipeline stage, on DeepSpeed's pipeline, and not with another way of
    saying what recomputes. Parsed in place (args.pp_recompute_layers becomes the counts)."""
    text = getattr(args, "pp_recompute_layers", None)
    if text is None or isinstance(text, tuple):
        return
    counts = parse_recompute_layers(text)
    recomputing = getattr(args, "checkpoint_activations", False) or getattr(args, "recompute_granularity", None)
    for given, flag in ((recomputing, "--checkpoint-activations or --recompute-granularity"),
                        (getattr(args, "no_pipeline_parallel", False), "--no-pipeline-parallel")):
        if given:
            raise PatchConfigError(f"{RECOMPUTE_FLAG} and {flag} cannot both be given: {RECOMPUTE_FLAG} says which "
                                   "layers each pipeline stage of DeepSpeed's pipeline recomputes")
    stages = getattr(args, "pipeline_model_parallel_size", 1)
    if len(counts) != stages:
        raise PatchConfigError(f"{RECOMPUTE_FLAG} {text} names {len(counts)} pipeline stages; "
                               f"--pipeline-model-parallel-size is {stages}")
    args.pp_recompute_layers = counts


def block_recompute_as_stage_counts(args: Namespace) -> None:
    """Megatron-LM's --recompute-granularity full --recompute-method block --recompute-num-layers N on DeepSpeed's
    pipeline: the first N transformer layers of every stage recompute, one by one, as --pp-recompute-layers
    N,N,... says; one definition for both trees (upstream's GPTModelPipe leaves it undone: "deepspeed's pipeline
    doesn't support the block recompute method")."""
    if (getattr(args, "pp_recompute_layers", None) is None
            and getattr(args, "recompute_granularity", None) == "full"
            and getattr(args, "recompute_method", None) == "block"):
        args.pp_recompute_layers = (args.recompute_num_layers,) * args.pipeline_model_parallel_size


def take_profiler_flags(args: Namespace, on_deepspeeds_pipeline: bool,
                        partition_report: Optional[str] = None) -> None:
    """block_recompute_as_stage_counts where the run is on DeepSpeed's pipeline (each tree says when: our fork
    but under --no-pipeline-parallel, upstream with --deepspeed too), check_profiler_flags, then set what the flags
    ask of every pipeline this process builds, in one place (process/registry.py's RunSettings): the memory limit
    every plan is made under (--pp-partition-memory-limit), the layers each stage recomputes (--pp-recompute-layers,
    or block recompute), Megatron's --no-load-optim across partitions, and partition_report: the report that cuts
    every PipelineModule, whatever its partition_method (upstream's --pp-partition-from-profile; our fork names it
    in the partition_method it builds with)."""
    from patches.process.registry import REGISTRY, RunSettings

    if on_deepspeeds_pipeline:
        block_recompute_as_stage_counts(args)
    check_profiler_flags(args)
    REGISTRY.settings = RunSettings(
        partition_report=partition_report, partition_memory_limit=memory_limit_of(args),
        drop_optimizer_state_across_partitions=bool(getattr(args, "no_load_optim", False)),
        recompute_layers=getattr(args, "pp_recompute_layers", None))


def unwritable_directory(path: str) -> Optional[str]:
    """Why a directory cannot be written to, or made and then written to; None where it can. Nothing is left
    behind (rank 0 makes the directory when it writes the report): the check makes a probe directory in the
    nearest existing ancestor and removes it."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return "it is a file"
    ancestor = path
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"{ancestor} is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".profile-flops-output-probe.", dir=ancestor))
    except OSError as error:
        return f"{ancestor}: {error.strerror}"
    return None
