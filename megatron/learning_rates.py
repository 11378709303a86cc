"""Megatron's learning-rate schedule: linear warm-up, then linear or cosine decay to min_lr."""
import math


class AnnealingLR:
    def __init__(self, optimizer, max_lr, min_lr, warmup_steps, decay_steps, decay_style):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr decay style {decay_style!r}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.num_steps = 0
        self._apply()

    def get_lr(self):
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return self.max_lr * self.num_steps / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.decay_steps:
            return self.min_lr
        span = max(self.decay_steps - self.warmup_steps, 1)
        ratio = (self.num_steps - self.warmup_steps) / span
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self):
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment=1):
        """Called by the DeepSpeed engine after each optimizer step."""
        self.num_steps += increment
        self._apply()

    def state_dict(self):
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps, "decay_style": self.decay_style}

    def load_state_dict(self, state):
        self.num_steps = state["num_steps"]
        self._apply()
