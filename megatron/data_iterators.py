"""From datasets to the micro-batch iterators DeepSpeed's engines consume.

Megatron's order: the global batch of an iteration is cut into micro-batches; within a micro-batch
slot, data-parallel rank r takes the r-th slice. The position is the number of consumed samples, so
a run resumed from a checkpoint continues with exactly the samples it would have seen.
"""
import numpy as np
import torch


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


def pipeline_batches(dataset, consumed_samples, micro_batch_size, data_parallel_size, data_parallel_rank):
    """Micro-batches as the PipelineEngine loads them: (inputs, (labels, loss_mask))."""
    for indices in micro_batch_indices(consumed_samples, micro_batch_size, data_parallel_size, data_parallel_rank):
        tokens, labels, loss_mask = gpt_batch([dataset[i % len(dataset)] for i in indices])
        yield tokens, (labels, loss_mask)
