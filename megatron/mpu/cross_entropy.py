"""Cross-entropy over logits whose vocabulary dimension is split over the tensor ranks.

No rank ever holds a full row of logits: the row maximum, the target's logit and the softmax
denominator are each all-reduced over the tensor group (a few scalars per token).
"""
import torch
import torch.distributed as dist

from megatron.mpu.parallel_state import get_tensor_model_parallel_group, get_tensor_model_parallel_rank
from megatron.mpu.utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        group = get_tensor_model_parallel_group()
        # Subtract the global row maximum so exp() cannot overflow; it cancels out of the loss.
        logits_max = vocab_parallel_logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = vocab_parallel_logits - logits_max.unsqueeze(-1)

        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(
            vocab_parallel_logits.size(-1), get_tensor_model_parallel_rank())
        outside = (target < first) | (target >= last)
        local_target = (target - first).masked_fill(outside, 0)
        # The target's (shifted) logit, from the one rank whose range holds it.
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)

        exp_logits = shifted.exp()
        sum_exp = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        loss = sum_exp.log() - target_logit
        softmax = exp_logits / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target); the one-hot lives on the target's rank only.
        minus_one_hot = (outside.to(softmax.dtype) - 1.0).unsqueeze(-1)
        grad_logits = softmax.scatter_add(-1, local_target.unsqueeze(-1), minus_one_hot)
        return grad_logits * grad_loss.unsqueeze(-1), None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    """Per-token loss, shaped like target, for logits [..., vocab / tp] split over the tensor ranks."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
