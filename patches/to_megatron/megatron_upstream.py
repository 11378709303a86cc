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
import functools
import inspect
import os
import sys
import weakref
from argparse import Namespace
from types import ModuleType
from typing import Callable, List

from patches.process import clean_exit
from patches.process.errors import exit_with_one_line
from patches.process.import_hooks import after_import
from patches.process.registry import REGISTRY
from patches.to_megatron.megatron_flags import PROFILE_STEP_FLAG
from patches.to_megatron.upstream_flags import parse_args_with_profiler_flags
from patches.to_megatron.upstream_run import UpstreamMegatronRun

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
    for module_name in run.patches:
        after_import(module_name, run.patch)


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
        # what each module of upstream's gets, as it is imported
        self.patches = {"megatron.arguments": self.patch_parse_args, "megatron.training": self.patch_train_step,
                        WEIGHT_GRAD_STORE: self.patch_weight_grad_store}

    def patch(self, module: ModuleType) -> None:
        """`module` is imported: its patch, unless this Megatron profiles through the patch set itself."""
        if not _profiles_itself():
            self.patches[module.__name__](module)

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
        original = getattr(module, "parse_args", None)
        if not callable(original) or "extra_args_provider" not in inspect.signature(original).parameters:
            self.missing("megatron.arguments.parse_args(extra_args_provider, ...)", module)
            return
        _replace(module, "parse_args", original, parse_args_with_profiler_flags(original))

    # ------------------------------------------------------------ the profiled iteration
    def patch_train_step(self, module: ModuleType) -> None:
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
                engine, iteration, functools.partial(original, *args, **kwargs))

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
            run = UpstreamMegatronRun(args, say, get_writer() if callable(get_writer) else None)
            self.door = MegatronDoor(args, run, first_done=iteration - 1)
        return self.door

    # ------------------------------------------------------------ the zero-bubble schedule
    def patch_weight_grad_store(self, module: ModuleType) -> None:
        """Upstream's WeightGradStore.put(total_input, grad_output, weight, func) keeps, in BackwardOnlyPass, the
        weight-gradient GEMM `func` of the parallel linear whose backward runs, and WeightPass runs it later,
        outside autograd. Handed over to the trained engine's measurement as that linear's deferred backward work,
        its FLOPs and time are the linear's backward, as under 1F1B (without this, the stage's). Absent or unlike
        upstream's: left alone."""
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


def _iteration_being_run(args: Namespace) -> int:
    """The 1-based iteration train() is running: it sets curr_iteration to the count done before train_step."""
    if not hasattr(args, "curr_iteration"):  # the same on every rank: all exit together
        exit_with_one_line("patches.launch: this Megatron's train() sets no args.curr_iteration before "
                           f"train_step: {PROFILE_STEP_FLAG} cannot find its iteration ({STILL_WORKS})")
    return args.curr_iteration + 1
