"""Megatron-DeepSpeed's learning-rate and weight-decay schedule, with its units, quirks and state keys.

The schedule counts in samples: one optimizer step advances it by the global batch size, so
`--lr-warmup-iters N` is N x global-batch samples and `--lr-warmup-samples N` is N samples.
`--lr-warmup-tokens` / `--lr-decay-tokens` count tokens instead; the token count the scheduler sees
at a step is the one the training loop had *before* that iteration (upstream reads its consumed-token
counter inside the optimizer step, before the loop adds the iteration's tokens), so token warm-up
starts one iteration late, exactly as upstream.

Learning rate: linear warm-up from 0 to --lr, then constant, linear, cosine or inverse-square-root
decay to --min-lr, and --min-lr after the decay span. Weight decay: constant, or rising from
--start-weight-decay to --end-weight-decay over the run (linear or cosine).

state_dict() has upstream's keys, so a checkpoint's scheduler state reads the same in both; on
load every value is checked against the flags (a mismatch stops the run) unless
--override-opt_param-scheduler (the flags win) or --use-checkpoint-opt_param-scheduler (the
checkpoint wins) is given.
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional

from megatron.utils import print_rank_0

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class SchedulerStateMismatch(ValueError):
    """A checkpoint's scheduler value differs from the flags' and neither override flag is given."""


@dataclass(frozen=True)
class ScheduleSpans:
    """The schedule's spans in samples (warm-up may be fractional with --lr-warmup-fraction)."""
    lr_warmup_steps: float
    lr_decay_steps: int
    wd_incr_steps: int


def schedule_spans(args) -> ScheduleSpans:
    """Upstream's mapping of the flags onto sample counts (iteration- or sample-based training)."""
    if args.train_samples is None:
        decay = (args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters) * args.global_batch_size
        wd_span = args.train_iters * args.global_batch_size
        warmup = args.lr_warmup_iters * args.global_batch_size
    else:
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        wd_span = args.train_samples
        warmup = args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return ScheduleSpans(lr_warmup_steps=warmup, lr_decay_steps=decay, wd_incr_steps=wd_span)


class OptimizerParamScheduler:
    """Sets every param group's lr and weight_decay (times the group's lr_mult / wd_mult) at each step.

    DeepSpeed's engine calls step() after every optimizer step it applies (not after an fp16 step
    skipped for overflow); without an argument the step is one global batch, `samples_per_step`.
    """

    def __init__(self, optimizer, max_lr: float, min_lr: float, lr_warmup_steps: float, lr_decay_steps: int,
                 lr_decay_style: str, start_wd: float, end_wd: float, wd_incr_steps: int, wd_incr_style: str,
                 samples_per_step: int, lr_warmup_tokens: Optional[int] = None,
                 lr_decay_tokens: Optional[int] = None, consumed_tokens: Callable[[], int] = lambda: 0,
                 use_checkpoint_opt_param_scheduler: bool = False, override_opt_param_scheduler: bool = False):
        if lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"unknown lr decay style {lr_decay_style!r}")
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"unknown weight decay increment style {wd_incr_style!r}")
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                             "exclude each other")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_warmup_tokens, self.lr_decay_tokens = lr_warmup_tokens, lr_decay_tokens
        self.lr_decay_style = lr_decay_style
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.samples_per_step = samples_per_step
        self.consumed_tokens = consumed_tokens
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        # With step-wise warm-up and token-wise decay the scheduler records the token count at the end of
        # warm-up as lr_warmup_tokens; that value comes from the run, not from a flag.
        self._warmup_tokens_from_run = lr_warmup_tokens is None and lr_decay_tokens is not None
        self.num_steps, self.num_tokens = 0, 0
        self.step(0)
        print_rank_0(f"> learning rate decay style: {self.lr_decay_style}")

    @classmethod
    def from_args(cls, optimizer, args, consumed_tokens: Callable[[], int]) -> "OptimizerParamScheduler":
        spans = schedule_spans(args)
        return cls(optimizer, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=spans.lr_warmup_steps,
                   lr_decay_steps=spans.lr_decay_steps, lr_decay_style=args.lr_decay_style,
                   start_wd=args.start_weight_decay, end_wd=args.end_weight_decay, wd_incr_steps=spans.wd_incr_steps,
                   wd_incr_style=args.weight_decay_incr_style, samples_per_step=args.global_batch_size,
                   lr_warmup_tokens=args.lr_warmup_tokens, lr_decay_tokens=args.lr_decay_tokens,
                   consumed_tokens=consumed_tokens,
                   use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
                   override_opt_param_scheduler=args.override_opt_param_scheduler)

    def get_wd(self) -> float:
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coefficient = ratio
        else:  # cosine: slow start, slow finish
            coefficient = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coefficient * (self.end_wd - self.start_wd)

    def get_lr(self) -> float:
        # Warm-up, counted in tokens when --lr-warmup-tokens is given, else in samples.
        if self.lr_warmup_tokens is None:
            if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
                if self.num_steps == self.lr_warmup_steps and self.lr_decay_tokens is not None:
                    self.lr_warmup_tokens = self.num_tokens  # token-wise decay starts from here
                return self.max_lr * self.num_steps / self.lr_warmup_steps
        elif self.lr_warmup_tokens > 0 and self.num_tokens <= self.lr_warmup_tokens:
            return self.max_lr * self.num_tokens / self.lr_warmup_tokens

        if self.lr_decay_style == "constant":
            return self.max_lr
        by_tokens = self.lr_decay_tokens is not None
        if (self.num_tokens > self.lr_decay_tokens) if by_tokens else (self.num_steps > self.lr_decay_steps):
            return self.min_lr

        if self.lr_decay_style == "inverse-square-root":
            if self.lr_warmup_tokens is None:
                warmed, done = max(self.lr_warmup_steps, 1), max(self.num_steps, 1)
            else:
                warmed, done = max(self.lr_warmup_tokens, 1), max(self.num_tokens, 1)
            return max(self.min_lr, self.max_lr * warmed ** 0.5 / done ** 0.5)

        if by_tokens:
            # No warm-up, or a sample warm-up that ended between steps, leaves no recorded warm-up tokens
            # (upstream fails there): decay from token 0.
            warmed = self.lr_warmup_tokens or 0
            ratio = (self.num_tokens - warmed) / (self.lr_decay_tokens - warmed)
        else:
            ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coefficient = 1.0 - ratio
        else:  # cosine
            coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def step(self, increment: Optional[int] = None, token_num: Optional[int] = None) -> None:
        """Advance by `increment` samples (default: one global batch) and set every group's lr and wd."""
        self.num_tokens = self.consumed_tokens() if token_num is None else token_num
        self.num_steps += self.samples_per_step if increment is None else increment
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr, "lr_warmup_steps": self.lr_warmup_steps, "lr_warmup_tokens": self.lr_warmup_tokens,
            "num_steps": self.num_steps, "num_tokens": self.num_tokens, "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps, "lr_decay_tokens": self.lr_decay_tokens, "min_lr": self.min_lr,
            "start_wd": self.start_wd, "end_wd": self.end_wd, "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, ours, theirs, name):
        """The value to use for `name`: the flags' (override), the checkpoint's, or both when they agree."""
        if self.override_opt_param_scheduler:
            print_rank_0(f" > overriding {name} value to {ours}")
            return ours
        if not self.use_checkpoint_opt_param_scheduler and ours != theirs:
            raise SchedulerStateMismatch(
                f"the checkpoint's learning-rate scheduler has {name} {theirs}, the flags give {ours}: pass "
                f"--override-opt_param-scheduler to use the flags' values or --use-checkpoint-opt_param-scheduler "
                f"to use the checkpoint's")
        print_rank_0(f" > using checkpoint value {theirs} for {name}")
        return theirs

    def load_state_dict(self, state: dict) -> None:
        # Older Megatron checkpoints name some values differently; read those too.
        def value(*keys):
            for key in keys:
                if key in state:
                    return state[key]
            return None

        self.max_lr = self._check_and_set(self.max_lr, value("start_lr", "max_lr"), "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, state["min_lr"], "minimum learning rate")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, value("warmup_iter", "warmup_steps", "lr_warmup_steps"), "warmup iterations")
        saved_warmup_tokens = value("warmup_tokens", "lr_warmup_tokens")
        if self._warmup_tokens_from_run:
            self.lr_warmup_tokens = saved_warmup_tokens
        else:
            self.lr_warmup_tokens = self._check_and_set(self.lr_warmup_tokens, saved_warmup_tokens, "warmup tokens")
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, value("end_iter", "decay_steps", "lr_decay_steps"), "total number of iterations")
        self.lr_decay_tokens = self._check_and_set(
            self.lr_decay_tokens, value("decay_tokens", "lr_decay_tokens"), "decay tokens")
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, value("decay_style", "lr_decay_style"), "learning rate decay style")
        if "start_wd" in state:
            self.start_wd = self._check_and_set(self.start_wd, state["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, state["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(
                self.wd_incr_steps, state["wd_incr_steps"], "total number of weight decay iterations")
            self.wd_incr_style = self._check_and_set(self.wd_incr_style, state["wd_incr_style"],
                                                     "weight decay incr style")
        saved_tokens = state.get("num_tokens", self.num_tokens)
        self.num_steps = 0
        self.step(increment=value("num_iters", "num_steps"), token_num=saved_tokens)
