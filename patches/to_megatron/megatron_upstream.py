"""Patches to upstream Megatron-DeepSpeed (deepspeedai/Megatron-DeepSpeed, or a fork of it): --profile-flops-step.

Upstream is recognized by what it has, not by its name; each part names what it needs when it is missing:
- `megatron.arguments.parse_args(extra_args_provider, ...)`: the profiler's flags join its parser;
- `megatron.training.train_step(forward_step_func, data_iterator, model, optimizer, ...)`, called by `train()`
  after it sets `args.curr_iteration`: the iteration asked for runs under the profiler on every rank;
- `megatron.global_vars.get_args()` (and `get_tensorboard_writer()`, where it exists).
Upstream's `pretrain` never ends its process groups: patches.process.clean_exit's teardown is registered to run at exit,
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

from patches.process import clean_exit
from patches.process.errors import PatchConfigError, exit_with_one_line
from patches.process.import_hooks import after_import
from patches.process.registry import REGISTRY
from patches.to_megatron.megatron_flags import (
    PROFILE_STEP_FLAG,
    add_profiler_flags,
    check_profiler_flags,
    memory_limit_of,
)

TRAIN_STEP_LEADING_PARAMETERS = ["forward_step_func", "data_iterator", "model", "optimizer"]
# Where upstream's zero-bubble schedule keeps the weight-gradient GEMMs it defers out of the backward pass.
WEIGHT_GRAD_STORE = "megatron.core.tensor_parallel.weight_grad_store"
STILL_WORKS = "the DeepSpeed config's flops_profiler section still profiles pipeline runs"


def install(argv: List[str]) -> None:
    """Patch the Megatron the script will import (now, if it is imported already). argv: the script's arguments,
    to know whether --profile-flops-step was asked for (a missing part is then an error, not a warning)."""
    if REGISTRY.megatron_patched:  # the launcher and a one-line edit both asked: patch once
        return
    REGISTRY.megatron_patched = True
    clean_exit.at_exit()  # before the script runs: after the handlers the run registers itself, it runs
    run = UpstreamRun(any(arg == PROFILE_STEP_FLAG or arg.startswith(PROFILE_STEP_FLAG + "=") for arg in argv))
    after_import("megatron.arguments", run.patch_parse_args)
    after_import("megatron.training", run.patch_train_step)
    after_import(WEIGHT_GRAD_STORE, run.patch_weight_grad_store)


def _profiles_itself() -> bool:
    """Our GPT fork says PROFILES_WITH_PATCHES = True in its package: it runs the patch set itself."""
    return bool(getattr(sys.modules.get("megatron"), "PROFILES_WITH_PATCHES", False))


def _replace(module: ModuleType, name: str, original: Callable, patched: Callable) -> None:
    """module.name = patched, and in every megatron module imported already that bound the original by name
    (`from megatron.arguments import parse_args`): the patches may be applied after the script's imports."""
    setattr(module, name, patched)
    for other_name, other in list(sys.modules.items()):
        if other_name.startswith("megatron") and other is not module and getattr(other, name, None) is original:
            setattr(other, name, patched)


class UpstreamRun:
    """The patches to one run's upstream Megatron, and what they keep: its door (megatron_door.MegatronDoor, made
    from its parsed arguments at its first train_step) and, weakly, the engine that train_step trains."""

    def __init__(self, profile_step_requested: bool):
        self.profile_step_requested = profile_step_requested
        self.door = None
        self.trained = None  # weakref.ref to model[0], the engine train_step trains

    def missing(self, what: str, module: ModuleType) -> None:
        """One line naming the upstream part not found; exit 2 when --profile-flops-step needs it."""
        where = getattr(module, "__file__", module.__name__)
        message = f"patches.launch: this Megatron has no {what} ({where}): --profile-flops-step is not available; "
        if self.profile_step_requested:
            exit_with_one_line(message + f"remove it ({STILL_WORKS})")
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"warning: {message}{STILL_WORKS}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------ the flags
    def patch_parse_args(self, module: ModuleType) -> None:
        if _profiles_itself():
            return
        original = getattr(module, "parse_args", None)
        if not callable(original) or "extra_args_provider" not in inspect.signature(original).parameters:
            self.missing("megatron.arguments.parse_args(extra_args_provider, ...)", module)
            return
        _replace(module, "parse_args", original, _parse_args_with_profiler_flags(original))

    # ------------------------------------------------------------ the profiled iteration
    def patch_train_step(self, module: ModuleType) -> None:
        if _profiles_itself():
            return
        original = getattr(module, "train_step", None)
        if not callable(original) or \
                list(inspect.signature(original).parameters)[:len(TRAIN_STEP_LEADING_PARAMETERS)] \
                != TRAIN_STEP_LEADING_PARAMETERS:
            self.missing(f"megatron.training.train_step({', '.join(TRAIN_STEP_LEADING_PARAMETERS)}, ...)", module)
            return
        global_vars = sys.modules.get("megatron.global_vars")
        if global_vars is None or not callable(getattr(global_vars, "get_args", None)):
            self.missing("megatron.global_vars.get_args()", module)
            return

        # the start-up line goes through upstream's own log function, as its other lines do
        say = getattr(module, "print_rank_0", None)
        if not callable(say):
            from patches.profiler.sources import say_on_rank_0 as say

        @functools.wraps(original)
        def train_step(*args, **kwargs):
            model = kwargs["model"] if "model" in kwargs else args[2]
            engine = model[0] if isinstance(model, (list, tuple)) and model else None
            if engine is None or not hasattr(engine, "global_steps"):  # not a DeepSpeed engine: nothing to do
                return original(*args, **kwargs)
            self.trained = weakref.ref(engine)
            megatron_args = global_vars.get_args()
            # Upstream's own timers are its business: the door times its train_step, the unprofiled
            # iterations the report compares with on the clock the profiled one is timed on.
            iteration = _iteration_being_run(megatron_args)
            return self.door_of(megatron_args, global_vars, iteration, say).train_step(
                engine, iteration, lambda: original(*args, **kwargs))

        _replace(module, "train_step", original, train_step)
        train = getattr(module, "train", None)
        if callable(train):  # the loop: where it ends, a report waiting for its baseline iterations comes
            _replace(module, "train", train, self._finishing(train))

    def _finishing(self, train: Callable) -> Callable:
        """upstream's train(), then the door's finish(): on its return, and on the sys.exit() its exit conditions
        (--exit-interval, --exit-duration-in-mins, a signal, the kill switch) make on every rank alike."""
        @functools.wraps(train)
        def finishing_train(*args, **kwargs):
            try:
                result = train(*args, **kwargs)
            except SystemExit:
                if self.door is not None:
                    self.door.finish()
                raise
            if self.door is not None:
                self.door.finish()
            return result

        return finishing_train

    def door_of(self, args: Namespace, global_vars: ModuleType, iteration: int, say: Callable[[str], None]):
        """The run's one door, made on its first iteration (`iteration`, after any checkpoint has loaded) from
        upstream's parsed arguments; say(line), upstream's print_rank_0, tells what it will profile, as the fork's
        train() does."""
        if self.door is None:
            from patches.to_megatron.megatron_door import MegatronDoor

            get_writer = getattr(global_vars, "get_tensorboard_writer", None)
            self.door = MegatronDoor(args, functools.partial(_describe_run, args), first_done=iteration - 1,
                                     tensorboard_writer=get_writer() if callable(get_writer) else None,
                                     shapes_change=shapes_change(args))
            if self.door.announcement is not None:
                say(f"> FLOPs profiler (patches): {self.door.announcement}; report files in "
                              f"{args.profile_flops_output}")
        return self.door

    # ------------------------------------------------------------ the zero-bubble schedule
    def patch_weight_grad_store(self, module: ModuleType) -> None:
        """Upstream's WeightGradStore.put(total_input, grad_output, weight, func) keeps, in BackwardOnlyPass, the
        weight-gradient GEMM `func` of the parallel linear whose backward runs, and WeightPass runs it later,
        outside autograd. Handed over to the trained engine's measurement as that linear's deferred backward work,
        its FLOPs and time are the linear's backward, as under 1F1B (without this, the stage's). Absent or unlike
        upstream's: left alone."""
        if _profiles_itself():
            return
        store = getattr(module, "WeightGradStore", None)
        put = inspect.getattr_static(store, "put", None) if store is not None else None
        if not isinstance(put, classmethod):
            return
        original = put.__func__

        @functools.wraps(original)
        def deferring_put(cls, *args, **kwargs):
            if args and callable(args[-1]):  # put(total_input, grad_output, weight, func)
                args = args[:-1] + (self.deferred(args[-1]),)
            return original(cls, *args, **kwargs)

        store.put = classmethod(deferring_put)

    def deferred(self, work):
        """work, handed to the measurement whose module's backward is running it now (deferred_backward gives back
        another callable only there): the engine train_step trains first, then any other engine measuring (one
        driven by the config section or by user code, outside upstream's train_step). Else work itself."""
        from patches.process.registry import REGISTRY
        from patches.profiler.attachment import attached

        engine = self.trained() if self.trained is not None else None
        trained = attached(engine) if engine is not None else None
        attachments = ([trained] if trained is not None else []) + [a for a in REGISTRY.attachments if a is not trained]
        for attachment in attachments:
            if attachment.measurement is not None:
                handed = attachment.measurement.deferred_backward(work)
                if handed is not work:
                    return handed
        return work


# ---------------------------------------------------------------- the flags
def check_upstream_profiler_flags(args: Namespace) -> None:
    """Raise PatchConfigError on a --profile-flops-step that could never run or report in upstream's run."""
    if args.profile_flops_step is not None and not getattr(args, "deepspeed", False):
        raise PatchConfigError(f"{PROFILE_STEP_FLAG} profiles a DeepSpeed engine: add --deepspeed")
    check_profiler_flags(args)


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
        from patches.partition.method import use_for_every_pipeline, use_memory_limit
        from patches.to_deepspeed.pipeline_checkpoint import drop_optimizer_state_across_partitions

        use_for_every_pipeline(parsed.pp_partition_from_profile)  # overrides GPTModelPipe's hard-coded method
        use_memory_limit(memory_limit_of(parsed))  # checked above: a size or None
        drop_optimizer_state_across_partitions(getattr(parsed, "no_load_optim", False))
        return parsed

    return parse_args


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
    iteration ran (curriculum learning's, where it is on). A fork whose arguments lack what the description
    reads gets a report without those lines."""
    from patches.profiler.context import UNDESCRIBED

    try:
        return _described(args, engine)
    except (AttributeError, TypeError):
        return UNDESCRIBED


def _described(args: Namespace, engine):
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


def iteration_seq_length(args: Namespace) -> int:
    """The sequence length the current iteration runs: curriculum learning's (args.curriculum_seqlen, which
    upstream's train() sets before each train_step) where it is on, else --seq-length."""
    seqlen = getattr(args, "curriculum_seqlen", None)
    return int(seqlen) if _curriculum(args) and seqlen else args.seq_length


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
