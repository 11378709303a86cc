"""From datasets to the micro-batch iterators DeepSpeed's engines consume.

Megatron's order: the global batch of an iteration is cut into micro-batches; within a micro-batch
slot, data-parallel rank r takes the r-th slice. The position is the number of consumed samples, so
a run resumed from a checkpoint continues with exactly the samples it would have seen.

Samples are read by a torch DataLoader with --num-workers worker processes (upstream's default, 2):
the batch sampler decides the order, so the micro-batches are the same with any number of workers.
"""
import numpy as np
import torch
from torch.utils.data import DataLoader

from megatron.tokenizer.tokenizer import padded_vocab_size


class SyntheticGPTDataset:
    """Learnable random sequences, reproducible per sample index (no file, no tokenizer).

    Each sample repeats a random 8-token motif drawn from a skewed (Zipf-like) distribution over
    the vocabulary: a model learns the frequencies first, then to copy the motif, so the loss
    falls. Used only when no --data-path is given; the log says so.
    """

    def __init__(self, num_samples, seq_length, vocab_size, seed):
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        rng = np.random.default_rng([self.seed, index])
        weights = 1.0 / np.arange(1, self.vocab_size + 1)
        motif = rng.choice(self.vocab_size, size=8, p=weights / weights.sum())
        return {"text": np.resize(motif, self.seq_length + 1).astype(np.int64)}


def synthetic_datasets(args, train_valid_test_num_samples):
    """(train, valid, test) synthetic datasets for a run without --data-path; sets args.padded_vocab_size."""
    args.padded_vocab_size = padded_vocab_size(args.synthetic_vocab_size, args)
    return tuple(SyntheticGPTDataset(n, args.seq_length, args.padded_vocab_size, args.seed + i)
                 for i, n in enumerate(train_valid_test_num_samples))


def micro_batch_indices(consumed_samples, micro_batch_size, data_parallel_size, data_parallel_rank):
    """Endless sample indices for this data-parallel rank's micro-batches, from consumed_samples on."""
    step = micro_batch_size * data_parallel_size
    start = consumed_samples
    while True:
        first = start + data_parallel_rank * micro_batch_size
        yield list(range(first, first + micro_batch_size))
        start += step


def gpt_batch(samples):
    """Tokens, labels shifted by one, and the loss mask (every token counts)."""
    text = torch.from_numpy(np.stack([np.asarray(s["text"], dtype=np.int64) for s in samples]))
    tokens = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    return tokens, labels, torch.ones_like(labels, dtype=torch.float32)


class _WrappedIndices:
    """The endless micro-batch index lists, wrapped into the dataset's range (an epoch is the dataset)."""

    def __init__(self, dataset_length, consumed_samples, micro_batch_size, data_parallel_size, data_parallel_rank):
        self.dataset_length = dataset_length
        self.sampler_args = (consumed_samples, micro_batch_size, data_parallel_size, data_parallel_rank)

    def __iter__(self):
        for indices in micro_batch_indices(*self.sampler_args):
            yield [i % self.dataset_length for i in indices]


def _pipeline_collate(samples):
    tokens, labels, loss_mask = gpt_batch(samples)
    return tokens, (labels, loss_mask)


def pipeline_batches(dataset, consumed_samples, micro_batch_size, data_parallel_size, data_parallel_rank,
                     num_workers=0):
    """Micro-batches as the PipelineEngine loads them: (inputs, (labels, loss_mask)), endless.

    num_workers > 0 reads them in that many DataLoader worker processes, each batch prefetched.
    """
    batch_sampler = _WrappedIndices(len(dataset), consumed_samples, micro_batch_size, data_parallel_size,
                                    data_parallel_rank)
    loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=_pipeline_collate, num_workers=num_workers,
                        persistent_workers=False)
    return iter(loader)
