"""Patches to upstream Megatron-DeepSpeed (deepspeedai/Megatron-DeepSpeed, or a fork of it): --profile-flops-step.

Upstream is recognized by what it has, not by its name; each part names what it needs when it is missing:
- `megatron.arguments.parse_args(extra_args_provider, ...)`: the profiler's flags join its parser;
- `megatron.training.train_step(forward_step_func, data_iterator, model, optimizer, ...)`, called by `train()`
  after it sets `args.curr_iteration`: the iteration asked for runs under the profiler on every rank;
- `megatron.global_vars.get_args()` (and `get_tensorboard_writer()`, where it exists).
Upstream's `pretrain` never ends its process groups: patches.clean_exit's teardown is registered to run at exit,
so that a run that finished does not abort in gloo's threads while the interpreter finalizes.
Nothing else of the user's Megatron is changed: an unprofiled iteration calls their own train_step.

A Megatron that profiles through the patch set itself (our GPT fork says so with `PROFILES_WITH_PATCHES = True`
in its package) is left alone.
"""
import copy
import functools
import inspect
import json
import os
import sys
import weakref
from argparse import Namespace
from types import ModuleType
from typing import Callable, List, Optional

from patches import clean_exit
from patches.errors import PatchConfigError, exit_with_one_line
from patches.import_hooks import after_import
from patches.megatron_flags import PROFILE_STEP_FLAG, add_profiler_flags, check_profiler_flags
from patches.profiler.module_profiler import defer_backward_work

TRAIN_STEP_LEADING_PARAMETERS = ["forward_step_func", "data_iterator", "model", "optimizer"]
# Where upstream's zero-bubble schedule keeps the weight-gradient GEMMs it defers out of the backward pass.
WEIGHT_GRAD_STORE = "megatron.core.tensor_parallel.weight_grad_store"
STILL_WORKS = "the DeepSpeed config's flops_profiler section still profiles pipeline runs"


class _State:
    """What install() was told, whether the Megatron found profiles itself, and the run's profile schedule."""
    installed = False
    profile_step_requested = False
    megatron_profiles_itself = False
    schedule = None  # one_step.ProfileSchedule, made from the parsed arguments on first use
    trained = None  # a weak reference to the engine upstream's train_step trains (model[0])


def install(argv: List[str]) -> None:
    """Patch the Megatron the script will import (now, if it is imported already). argv: the script's arguments,
    to know whether --profile-flops-step was asked for (a missing part is then an error, not a warning)."""
    _State.profile_step_requested = any(arg == PROFILE_STEP_FLAG or arg.startswith(PROFILE_STEP_FLAG + "=")
                                        for arg in argv)
    if _State.installed:  # the launcher and a one-line edit both asked: patch once
        return
    _State.installed = True
    clean_exit.at_exit()  # before the script runs: after the handlers the run registers itself, it runs
    after_import("megatron", _note_self_profiling)
    after_import("megatron.arguments", _patch_parse_args)
    after_import("megatron.training", _patch_train_step)
    after_import(WEIGHT_GRAD_STORE, _patch_weight_grad_store)


def _note_self_profiling(package: ModuleType) -> None:
    _State.megatron_profiles_itself = bool(getattr(package, "PROFILES_WITH_PATCHES", False))


def _missing(what: str, module: ModuleType) -> None:
    """One line naming the upstream part not found; exit 2 when --profile-flops-step needs it."""
    where = getattr(module, "__file__", module.__name__)
    message = f"patches.launch: this Megatron has no {what} ({where}): --profile-flops-step is not available; "
    if _State.profile_step_requested:
        exit_with_one_line(message + f"remove it ({STILL_WORKS})")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: {message}{STILL_WORKS}", file=sys.stderr, flush=True)


def _replace(module: ModuleType, name: str, original: Callable, patched: Callable) -> None:
    """module.name = patched, and in every megatron module imported already that bound the original by name
    (`from megatron.arguments import parse_args`): the patches may be applied after the script's imports."""
    setattr(module, name, patched)
    for other_name, other in list(sys.modules.items()):
        if other_name.startswith("megatron") and other is not module and getattr(other, name, None) is original:
            setattr(other, name, patched)


# ---------------------------------------------------------------- the flags
def check_upstream_profiler_flags(args: Namespace) -> None:
    """Raise PatchConfigError on a --profile-flops-step that could never run or report in upstream's run."""
    if args.profile_flops_step is not None and not getattr(args, "deepspeed", False):
        raise PatchConfigError(f"{PROFILE_STEP_FLAG} profiles a DeepSpeed engine: add --deepspeed")
    check_profiler_flags(args)


def _patch_parse_args(module: ModuleType) -> None:
    if _State.megatron_profiles_itself:
        return
    original = getattr(module, "parse_args", None)
    if not callable(original) or "extra_args_provider" not in inspect.signature(original).parameters:
        _missing("megatron.arguments.parse_args(extra_args_provider, ...)", module)
        return
    _replace(module, "parse_args", original, _parse_args_with_profiler_flags(original))


def _parse_args_with_profiler_flags(original: Callable) -> Callable:
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
        from patches.partition_profile import use_for_every_pipeline
        from patches.pipeline_checkpoint import drop_optimizer_state_across_partitions

        use_for_every_pipeline(parsed.pp_partition_from_profile)  # overrides GPTModelPipe's hard-coded method
        drop_optimizer_state_across_partitions(getattr(parsed, "no_load_optim", False))
        _announce(parsed)
        return parsed

    return parse_args


def _announce(args: Namespace) -> None:
    if args.profile_flops_step is None:
        return
    from patches.flops_profiler_config import yield_to_flag
    from patches.profiler.one_step import counting_announcement

    yield_to_flag(args.profile_flops_step)
    if int(os.environ.get("RANK", "0")) == 0:
        # Upstream loads its checkpoint after parsing: where this run starts is not known yet.
        where = counting_announcement(args.profile_flops_step, args.profile_flops_counting, None, shapes_change(args))
        print(f"> FLOPs profiler (patches): iteration {args.profile_flops_step} will be profiled on every stage"
              f"{where}; report files in {args.profile_flops_output}", flush=True)


# ---------------------------------------------------------------- the profiled iteration
def _patch_train_step(module: ModuleType) -> None:
    if _State.megatron_profiles_itself:
        return
    original = getattr(module, "train_step", None)
    if not callable(original) or \
            list(inspect.signature(original).parameters)[:len(TRAIN_STEP_LEADING_PARAMETERS)] \
            != TRAIN_STEP_LEADING_PARAMETERS:
        _missing(f"megatron.training.train_step({', '.join(TRAIN_STEP_LEADING_PARAMETERS)}, ...)", module)
        return
    global_vars = sys.modules.get("megatron.global_vars")
    if global_vars is None or not callable(getattr(global_vars, "get_args", None)):
        _missing("megatron.global_vars.get_args()", module)
        return
    _replace(module, "train_step", original, _profiling_train_step(original, global_vars))
    from patches.profiler.context import register_run_describer

    register_run_describer(functools.partial(_describe_current_run, global_vars))


def _profiling_train_step(original: Callable, global_vars: ModuleType) -> Callable:
    @functools.wraps(original)
    def train_step(*args, **kwargs):
        model = kwargs["model"] if "model" in kwargs else args[2]
        _remember_trained(model)
        megatron_args = global_vars.get_args()
        if getattr(megatron_args, "profile_flops_step", None) is None:
            return original(*args, **kwargs)
        # Upstream's own timers are its business: the schedule times its train_step, the unprofiled
        # iterations the report compares with on the clock the profiled one is timed on.
        return _schedule_of(megatron_args, global_vars).run(model[0], _iteration_being_run(megatron_args),
                                                            lambda: original(*args, **kwargs))

    return train_step


def _remember_trained(model) -> None:
    """The engine upstream's arguments describe (model[0], a DeepSpeed engine), weakly, for _describe_current_run."""
    engine = model[0] if isinstance(model, (list, tuple)) and model else None
    if engine is not None and (_State.trained is None or _State.trained() is not engine):
        try:
            _State.trained = weakref.ref(engine)
        except TypeError:  # not an engine: nothing to describe
            _State.trained = None


def _schedule_of(args: Namespace, global_vars: ModuleType):
    """The run's one ProfileSchedule, made on first use from upstream's parsed arguments."""
    from patches.profiler.one_step import FileOutput, ProfileSchedule

    if _State.schedule is None:
        get_writer = getattr(global_vars, "get_tensorboard_writer", None)
        writer = get_writer() if callable(get_writer) else None
        _State.schedule = ProfileSchedule(args.profile_flops_step, functools.partial(_describe_run, args),
                                          FileOutput(args.profile_flops_output, writer),
                                          counting=args.profile_flops_counting, shapes_change=shapes_change(args),
                                          last_iteration=getattr(args, "train_iters", None))
    return _State.schedule


def shapes_change(args: Namespace) -> Optional[str]:
    """Why upstream's iterations differ in shape, as its arguments (and DeepSpeed config) say, or None: curriculum
    learning truncates each batch to args.curriculum_seqlen, random-LTD drops tokens in the middle layers."""
    reasons = [_curriculum(args), "random-LTD" if getattr(args, "random_ltd", False) else None]
    return ", ".join(reason for reason in reasons if reason) or None


def _curriculum(args: Namespace) -> Optional[str]:
    """The curriculum learning that shortens upstream's sequences to args.curriculum_seqlen, or None."""
    if getattr(args, "curriculum_learning_legacy", False) or _config_section_enabled(args, "curriculum_learning"):
        return "curriculum learning (the DeepSpeed config's curriculum_learning section)"
    if getattr(args, "data_efficiency_curriculum_learning", False):
        return "data-efficiency curriculum learning"
    return None


def _config_section_enabled(args: Namespace, section: str) -> bool:
    """Whether the DeepSpeed config enables `section`: upstream reads its config only after parsing the flags
    (into args.deepspeed_config_dict), so before that the file is read here."""
    config = getattr(args, "deepspeed_config_dict", None)
    if config is None and getattr(args, "deepspeed_config", None) and os.path.isfile(args.deepspeed_config):
        try:
            with open(args.deepspeed_config) as f:
                config = json.load(f)
        except ValueError:  # upstream's own reading of it says what is wrong
            config = None
    return bool(((config or {}).get(section) or {}).get("enabled", False))


def _iteration_being_run(args: Namespace) -> int:
    """The 1-based iteration train() is running: it sets curr_iteration to the count done before train_step."""
    if not hasattr(args, "curr_iteration"):  # the same on every rank: all exit together
        exit_with_one_line("patches.launch: this Megatron's train() sets no args.curr_iteration before "
                           f"train_step: {PROFILE_STEP_FLAG} cannot find its iteration ({STILL_WORKS})")
    return args.curr_iteration + 1


def _describe_run(args: Namespace, engine):
    """What upstream's arguments say of the run, for the report (RunDescription): at the sequence length the
    iteration ran (curriculum learning's, where it is on)."""
    from patches.profiler.analytic_flops import recompute_shortfall
    from patches.profiler.context import RunDescription

    view, stage_layers = _analytic_view(args, engine)
    if getattr(args, "random_ltd", False) or getattr(args, "data_efficiency_curriculum_learning", False):
        # random-LTD drops tokens in the middle layers and the data-efficiency pipeline may reshape the batch:
        # no formula of batch x length says what ran, so the report states only what was measured
        return RunDescription(seq_length=view.seq_length)
    analytic = upstream_analytic_flops(view, stage_layers)
    log_line = copy.copy(args)  # upstream's log line reads its own flags, at the iteration's length
    log_line.seq_length = view.seq_length
    return RunDescription(seq_length=view.seq_length, analytic=analytic,
                          recompute_note=recompute_shortfall(view, stage_layers) if analytic else None,
                          log_line_flops=upstream_log_line_flops(log_line))


def _describe_current_run(global_vars: ModuleType, engine):
    """_describe_run of upstream's parsed arguments, for the reports its train_step does not ask for (the config
    section's, the user's own FlopsProfiler code's); None for another engine than the one train_step trains,
    or for a fork whose arguments lack what the description reads."""
    if _State.trained is None or _State.trained() is not engine:
        return None
    try:
        return _describe_run(global_vars.get_args(), engine)
    except (AttributeError, TypeError):  # a fork without these arguments: the report has no such lines
        return None


def iteration_seq_length(args: Namespace) -> int:
    """The sequence length the current iteration runs: curriculum learning's (args.curriculum_seqlen, which
    upstream's train() sets before each train_step) where it is on, else --seq-length."""
    seqlen = getattr(args, "curriculum_seqlen", None)
    return int(seqlen) if _curriculum(args) and seqlen else args.seq_length


# ---------------------------------------------------------------- the zero-bubble schedule
def _patch_weight_grad_store(module: ModuleType) -> None:
    """Upstream's WeightGradStore.put(total_input, grad_output, weight, func) keeps, in BackwardOnlyPass, the
    weight-gradient GEMM `func` of the parallel linear whose backward runs, and WeightPass runs it later,
    outside autograd. Handed over as that linear's deferred backward work, its FLOPs and time are the
    linear's backward, as under 1F1B (without this, the stage's). Absent or unlike upstream's: left alone."""
    if _State.megatron_profiles_itself:
        return
    store = getattr(module, "WeightGradStore", None)
    put = inspect.getattr_static(store, "put", None) if store is not None else None
    if not isinstance(put, classmethod):
        return
    original = put.__func__

    @functools.wraps(original)
    def deferring_put(cls, *args, **kwargs):
        if args and callable(args[-1]):  # put(total_input, grad_output, weight, func)
            args = args[:-1] + (defer_backward_work(args[-1]),)
        return original(cls, *args, **kwargs)

    store.put = classmethod(deferring_put)


def upstream_log_line_flops(args: Namespace) -> Optional[float]:
    """The FLOPs upstream's log line counts for one iteration (its throughput convention, in
    patches.profiler.analytic_flops), or None where this Megatron's arguments lack what it reads."""
    from patches.profiler.analytic_flops import upstream_flops_per_iteration

    try:
        return upstream_flops_per_iteration(args)
    except (AttributeError, TypeError):
        return None


def pipeline_stage_layers_of(module) -> Optional[list]:
    """Each stage's layers of a DeepSpeed PipelineModule (a transformer layer as its number 1..L, the others by
    name), read from its layer specs and stage boundaries (private names; None where they are missing)."""
    specs, parts = getattr(module, "_layer_specs", None), getattr(module, "parts", None)
    if specs is None or parts is None:
        return None
    names, number = [], 0
    for spec in specs:
        name = getattr(getattr(spec, "typename", spec), "__name__", type(spec).__name__)
        if "ParallelTransformerLayerPipe" in name:  # what PipelineModule checkpoints in a GPT model
            number += 1
            names.append(number)
        else:
            names.append(name)
    return [names[parts[i]:parts[i + 1]] for i in range(len(parts) - 1)]


def _analytic_view(args: Namespace, engine):
    """(upstream's arguments as the analytic formula reads them, each stage's layers or None). Upstream's
    GPTModelPipe checkpoints every activation_checkpoint_interval layers (--checkpoint-num-layers, or
    --recompute-num-layers under --recompute-granularity full --recompute-method uniform), by DeepSpeed's
    chunk rule; a plain engine (--no-pipeline-parallel) checkpoints inside its own transformer."""
    view = copy.copy(args)
    view.seq_length = iteration_seq_length(args)
    view.num_micro_batches = engine.gradient_accumulation_steps()
    stage_layers = pipeline_stage_layers_of(engine.module)
    if stage_layers is not None:
        interval = getattr(engine.module, "activation_checkpoint_interval", 0)
        view.checkpoint_activations, view.checkpoint_num_layers = interval > 0, max(interval, 1)
        view.recompute_method, view.no_pipeline_parallel = "uniform", False
    else:
        granularity, method = getattr(args, "recompute_granularity", None), getattr(args, "recompute_method", None)
        view.checkpoint_activations = bool(getattr(args, "checkpoint_activations", False)) or \
            (granularity, method) == ("full", "uniform")
        view.recompute_method = "uniform"
    return view, stage_layers


def upstream_analytic_flops(view: Namespace, stage_layers: Optional[list]) -> Optional[dict]:
    """The Megatron-LM formula (patches.profiler.analytic_flops) on upstream's arguments, or None where this
    Megatron's arguments lack what it needs."""
    from patches.profiler.analytic_flops import gpt_flops_per_iteration

    try:
        return gpt_flops_per_iteration(view, stage_layers=stage_layers)
    except (AttributeError, TypeError):  # a fork without these arguments: the report has no analytic column
        return None
