"""AdamW that clips gradients by their true global norm over the whole model.

DeepSpeed's fp32 clipping under a pipeline asks the grid's "model parallel" rank, which spans
pipeline x tensor, so it drops the replicated parameters of every stage but the first and counts
the tied embedding twice. Here each gradient element of the dense model is counted exactly once:
tensor-parallel shards on every tensor rank, replicated parameters on tensor rank 0 only, and tied
pipeline weights on their first stage only; the squares are then summed over the tensor and
pipeline groups. Gradients are already averaged over data-parallel ranks when step() runs.
"""
import torch
import torch.distributed as dist

from megatron import mpu


def counts_in_norm(param):
    if getattr(param, "pipeline_tied_duplicate", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or mpu.get_tensor_model_parallel_rank() == 0


def global_grad_norm(params):
    grads = [p.grad.detach().float() for p in params if p.grad is not None and counts_in_norm(p)]
    squares = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else None)
    for grad in grads:
        squares += grad.norm() ** 2
    dist.all_reduce(squares, group=mpu.get_tensor_model_parallel_group())
    dist.all_reduce(squares, group=mpu.get_pipeline_model_parallel_group())
    return squares.sqrt().item()


class ClippedAdamW(torch.optim.AdamW):
    """AdamW whose step() first clips by the global norm (clip_grad 0 disables clipping)."""

    def __init__(self, params, clip_grad, **kwargs):
        super().__init__(params, **kwargs)
        self.clip_grad = clip_grad
        self._global_grad_norm = None  # DeepSpeed's engine reports this as its grad norm

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
        return super().step(closure)


def mark_tied_duplicates(pipeline_module):
    """On every stage but the first, the tied modules' parameters are copies of the first stage's."""
    if mpu.is_pipeline_first_stage():
        return
    for param in pipeline_module.tied_modules.parameters():
        param.pipeline_tied_duplicate = True
