"""Megatron-DeepSpeed's training log line, field for field, and its throughput figures.

    iteration  3/  5 | consumed samples: 24 | consumed tokens: 384 | elapsed time per iteration (ms): 812.3 |
    learning rate: 1.000E-03 | global batch size: 8 | lm loss: 5.123456E+00 | loss scale: 2048.0 |
    grad norm: 1.234 | actual seqlen: 16 | number of skipped iterations: 0 | number of nan iterations: 0 |
    samples per second: 9.848 | tokens per gpu per second (tgs): 39.394 | TFLOPs: 0.00 |

(one line). "loss scale" appears with fp16 only, "grad norm" when the engine has one, "num zeros" with
--log-num-zeros-in-grad (upstream's pipeline path prints 0.0 there whatever the gradients; this is the
count), "params norm" with --log-params-norm, "lm loss" when an iteration of the interval advanced.
Throughput is upstream's: samples/s of the whole global batch, tokens per second per GPU (tgs), and
TFLOPs per GPU as the whole global batch's FLOPs (upstream's formula: patches.to_megatron.analytic_flops, read from
the run's description) over seconds per iteration times the world size.
"""
import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class IntervalStats:
    """What the iterations since the last log line add up to (upstream's total_loss_dict)."""
    loss_sum: float = 0.0
    advanced: int = 0
    skipped: int = 0
    nan: int = 0

    def add(self, loss: float, skipped: bool) -> None:
        if skipped:
            # An fp16 step DeepSpeed's loss scaler skipped: its loss is left out; inf/nan ones are counted.
            self.skipped += 1
            self.nan += int(not math.isfinite(loss))
        else:
            self.advanced += 1
            self.loss_sum += loss

    @property
    def iterations(self) -> int:
        return self.advanced + self.skipped

    @property
    def mean_loss(self) -> Optional[float]:
        mean = self.loss_sum / max(1, self.advanced)
        return mean if mean > 0.0 else None  # upstream prints no loss when nothing advanced


@dataclass(frozen=True)
class Throughput:
    samples_per_second: float
    tokens_per_gpu_per_second: float
    tflops: float


def throughput(args, seconds_per_iteration: float, flops_per_iteration: float) -> Throughput:
    """Upstream's figures for one iteration of the whole global batch (`flops_per_iteration`: upstream's
    formula's) taking `seconds_per_iteration`."""
    samples_per_second = args.global_batch_size / seconds_per_iteration
    tokens_per_gpu = samples_per_second * args.seq_length / args.world_size
    tflops = flops_per_iteration / (seconds_per_iteration * args.world_size * 1e12)
    return Throughput(samples_per_second, tokens_per_gpu, tflops)


@dataclass
class TrainingLogLine:
    iteration: int
    train_iters: int
    consumed_samples: int
    consumed_tokens: int
    seconds_per_iteration: float
    learning_rate: float
    global_batch_size: int
    lm_loss: Optional[float]
    loss_scale: Optional[float]
    grad_norm: Optional[float]
    params_norm: Optional[float]
    actual_seqlen: int
    skipped_iterations: int
    nan_iterations: int
    rates: Throughput
    extra: list = field(default_factory=list)
    num_zeros: Optional[float] = None  # with --log-num-zeros-in-grad

    def format(self) -> str:
        parts = [f" iteration {self.iteration:8d}/{self.train_iters:8d}",
                 f" consumed samples: {self.consumed_samples:12d}",
                 f" consumed tokens: {self.consumed_tokens:12d}",
                 f" elapsed time per iteration (ms): {self.seconds_per_iteration * 1000.0:.1f}",
                 f" learning rate: {self.learning_rate:.3E}",
                 f" global batch size: {self.global_batch_size:5d}"]
        if self.lm_loss is not None:
            parts.append(f" lm loss: {self.lm_loss:.6E}")
        if self.loss_scale is not None:
            parts.append(f" loss scale: {self.loss_scale:.1f}")
        if self.grad_norm is not None:
            parts.append(f" grad norm: {self.grad_norm:.3f}")
        if self.num_zeros is not None:
            parts.append(f" num zeros: {self.num_zeros:.1f}")
        if self.params_norm is not None:
            parts.append(f" params norm: {self.params_norm:.3f}")
        parts += [f" actual seqlen: {self.actual_seqlen:5d}",
                  f" number of skipped iterations: {self.skipped_iterations:3d}",
                  f" number of nan iterations: {self.nan_iterations:3d}",
                  f" samples per second: {self.rates.samples_per_second:.3f}",
                  f" tokens per gpu per second (tgs): {self.rates.tokens_per_gpu_per_second:.3f}",
                  f" TFLOPs: {self.rates.tflops:.2f}"]
        return "".join(part + " |" for part in parts)


# The log line's field names, in upstream's order (those that may be absent are marked).
FIELD_ORDER = ("iteration", "consumed samples", "consumed tokens", "elapsed time per iteration (ms)",
               "learning rate", "global batch size", "lm loss", "loss scale", "grad norm", "num zeros", "params norm",
               "actual seqlen", "number of skipped iterations", "number of nan iterations", "samples per second",
               "tokens per gpu per second (tgs)", "TFLOPs")
OPTIONAL_FIELDS = ("lm loss", "loss scale", "grad norm", "num zeros", "params norm")
