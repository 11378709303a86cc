"""Megatron's optimizers (AdamW, SGD) clipping gradients by their true global norm over the whole model.

DeepSpeed's fp32 clipping under a pipeline asks the grid's "model parallel" rank, which spans
pipeline x tensor, so it drops the replicated parameters of every stage but the first and counts
the tied embedding twice. Here each gradient element of the dense model is counted exactly once:
tensor-parallel shards on every tensor rank, replicated parameters on tensor rank 0 only, and tied
pipeline weights on their first stage only; the squares are then summed over the tensor and
pipeline groups. Gradients are already averaged over data-parallel ranks when step() runs.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron import mpu


def counts_in_norm(param):
    if getattr(param, "pipeline_tied_duplicate", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or mpu.get_tensor_model_parallel_rank() == 0


def _model_parallel_sum(tensors, of):
    """sum(of(tensor)) over these tensors and the tensor and pipeline groups (collective on both)."""
    total = torch.zeros(1, dtype=torch.float32, device=tensors[0].device if tensors else None)
    for tensor in tensors:
        total += of(tensor.detach())
    dist.all_reduce(total, group=mpu.get_tensor_model_parallel_group())
    dist.all_reduce(total, group=mpu.get_pipeline_model_parallel_group())
    return total.item()


def _model_parallel_norm(tensors):
    """L2 norm of these tensors over the tensor and pipeline groups (collective on both)."""
    return math.sqrt(_model_parallel_sum(tensors, lambda t: t.float().norm() ** 2))


def global_grad_norm(params):
    return _model_parallel_norm([p.grad for p in params if p.grad is not None and counts_in_norm(p)])


def global_zeros_in_grad(params):
    """Upstream's --log-num-zeros-in-grad figure: zero gradient elements of the dense model, each counted once."""
    return _model_parallel_sum([p.grad for p in params if p.grad is not None and counts_in_norm(p)],
                               lambda t: (t == 0).sum())


def global_params_norm(module):
    """The dense model's parameter L2 norm, every element once (upstream's --log-params-norm); collective."""
    return _model_parallel_norm([p for p in module.parameters() if counts_in_norm(p)])


class _ClipByGlobalNorm:
    """step() first clips the gradients by their global norm (clip_grad 0 disables clipping)."""

    def __init__(self, params, clip_grad, count_zeros=False, **kwargs):
        super().__init__(params, **kwargs)
        self.clip_grad = clip_grad
        self._global_grad_norm = None  # DeepSpeed's engine reports this as its grad norm
        self.count_zeros = count_zeros  # --log-num-zeros-in-grad
        self.num_zeros_in_grad = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        self._global_grad_norm = global_grad_norm(params)
        if self.clip_grad > 0:
            coefficient = self.clip_grad / (self._global_grad_norm + 1e-6)
            if coefficient < 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coefficient)
        if self.count_zeros:
            self.num_zeros_in_grad = global_zeros_in_grad(params)
        return super().step(closure)


class ClippedAdamW(_ClipByGlobalNorm, torch.optim.AdamW):
    """AdamW clipping by the global gradient norm (upstream's --optimizer adam is AdamW)."""


class ClippedSGD(_ClipByGlobalNorm, torch.optim.SGD):
    """SGD with momentum clipping by the global gradient norm (upstream's --optimizer sgd)."""


def get_param_groups(module):
    """Weight decay on matrices only: biases and LayerNorm parameters get wd_mult 0, as upstream.

    The scheduler sets each group's weight_decay to the scheduled value times its wd_mult.
    """
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            (no_decay if param.ndim == 1 else decay).append(param)
    # Upstream's names, saved with each group in the checkpoint.
    return [{"name": "wd_no_scale_lr", "params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
            {"name": "no_wd_no_scale_lr", "params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0}]


def build_optimizer(args, module):
    """--optimizer adam (AdamW) or sgd over the module's parameter groups.

    DeepSpeed's fp16/bf16 and ZeRO optimizers wrap this one, hand it flat partitions and clip by
    themselves: then it is the plain torch optimizer (which ZeRO also knows as tested).
    """
    wrapped = args.fp16 or args.bf16 or args.zero_stage > 0
    groups = get_param_groups(module)
    if args.optimizer == "adam":
        kwargs = dict(lr=args.lr, weight_decay=args.start_weight_decay, betas=(args.adam_beta1, args.adam_beta2),
                      eps=args.adam_eps)
        return torch.optim.AdamW(groups, **kwargs) if wrapped else ClippedAdamW(
            groups, clip_grad=args.clip_grad, count_zeros=args.log_num_zeros_in_grad, **kwargs)
    kwargs = dict(lr=args.lr, weight_decay=args.start_weight_decay, momentum=args.sgd_momentum)
    return torch.optim.SGD(groups, **kwargs) if wrapped else ClippedSGD(
        groups, clip_grad=args.clip_grad, count_zeros=args.log_num_zeros_in_grad, **kwargs)


@dataclass(frozen=True)
class OptimizerStateStats:
    """Upstream's --log-optimizer-states-to-tensorboard figures: Adam's second moment (variance), its
    square root, the first moment (momentum) and the weights, as L2 and L1 norms and largest magnitudes.

    As upstream, each rank sums what its optimizer holds and the sums are added over the tensor and
    pipeline groups (and data-parallel ranks under ZeRO): parameters held by several ranks (replicated
    across tensor ranks, the tied embedding) count once per holder.
    """
    l2: dict
    l1: dict
    abs_max: dict


def optimizer_state_stats(optimizer, zero_stage):
    """Collective over the tensor and pipeline groups (and the data-parallel group under ZeRO)."""
    state = getattr(optimizer, "state", None) or optimizer.optimizer.state
    sums = torch.zeros(8, dtype=torch.float64)
    maxima = torch.zeros(4, dtype=torch.float64)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param not in state or "exp_avg" not in state[param]:
                continue
            variance, momentum = state[param]["exp_avg_sq"].float(), state[param]["exp_avg"].float()
            tensors = (variance, variance.sqrt(), momentum, param.detach().float())
            for index, tensor in enumerate(tensors):
                sums[index] += tensor.norm().item() ** 2
                sums[4 + index] += tensor.norm(p=1).item()
                maxima[index] = max(maxima[index].item(), tensor.abs().max().item() if tensor.numel() else 0.0)
    groups = [mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group()]
    if zero_stage > 0:
        groups.append(mpu.get_data_parallel_group())
    for group in groups:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    names = ("variance", "variance_sqrt", "momentum", "weight")
    return OptimizerStateStats(l2={n: sums[i].item() ** 0.5 for i, n in enumerate(names)},
                               l1={n: sums[4 + i].item() for i, n in enumerate(names)},
                               abs_max={n: maxima[i].item() for i, n in enumerate(names)})


def mark_tied_duplicates(pipeline_module):
    """On every stage but the first, the tied modules' parameters are copies of the first stage's."""
    if mpu.is_pipeline_first_stage():
        return
    for param in pipeline_module.tied_modules.parameters():
        param.pipeline_tied_duplicate = True
