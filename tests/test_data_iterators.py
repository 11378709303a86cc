"""The micro-batch iterator: Megatron's sample order per data-parallel rank, resumed from consumed samples,
and the same batches whether the DataLoader reads them in-line or in worker processes (--num-workers)."""
from itertools import islice

import torch

from megatron.data_iterators import SyntheticGPTDataset, pipeline_batches

DATASET = SyntheticGPTDataset(num_samples=10, seq_length=6, vocab_size=50, seed=3)


def first_batches(count, **kwargs):
    return list(islice(pipeline_batches(DATASET, **kwargs), count))


def sample(index):
    return torch.from_numpy(DATASET[index]["text"])


def test_rank_slices_wrap_and_resume():
    # micro-batch 2, dp 2, rank 1, 4 samples already consumed: indices 6,7 then 10,11 -> 0,1 (the epoch wraps)
    batches = first_batches(2, consumed_samples=4, micro_batch_size=2, data_parallel_size=2, data_parallel_rank=1)
    for (tokens, (labels, loss_mask)), indices in zip(batches, ([6, 7], [0, 1])):
        text = torch.stack([sample(i) for i in indices])
        assert torch.equal(tokens, text[:, :-1]) and torch.equal(labels, text[:, 1:])
        assert torch.equal(loss_mask, torch.ones(2, 6))


def test_worker_processes_give_the_same_batches():
    layout = dict(consumed_samples=2, micro_batch_size=3, data_parallel_size=2, data_parallel_rank=0)
    inline = first_batches(5, num_workers=0, **layout)
    workers = first_batches(5, num_workers=2, **layout)
    for (tokens_a, (labels_a, mask_a)), (tokens_b, (labels_b, mask_b)) in zip(inline, workers):
        assert torch.equal(tokens_a, tokens_b) and torch.equal(labels_a, labels_b) and torch.equal(mask_a, mask_b)
