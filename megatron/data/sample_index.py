"""The three index arrays behind a GPT dataset, computed as Megatron computes them.

doc_idx     the split's documents repeated once per epoch, shuffled (the last epoch on its own
            when it is used for less than 80% of its samples, so it does not dilute the others)
sample_idx  (position in doc_idx, token offset) where each sample starts; sample i covers tokens
            [i * seq_length, (i + 1) * seq_length] of the doc_idx token stream, seq_length + 1 tokens
shuffle_idx the order samples are served in
All draws come from one numpy RandomState(seed), in the order doc_idx then shuffle_idx.
"""
import numpy as np


def num_epochs(tokens_per_epoch, seq_length, num_samples):
    """Fewest epochs whose token stream yields num_samples samples of seq_length + 1 tokens."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split holds no tokens; check --split and the dataset")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def samples_before_last_epoch(epochs, tokens_per_epoch, seq_length):
    return ((epochs - 1) * tokens_per_epoch - 1) // seq_length


def separate_last_epoch(epochs, tokens_per_epoch, seq_length, num_samples):
    if epochs == 1:
        return False
    last_epoch_samples = num_samples - samples_before_last_epoch(epochs, tokens_per_epoch, seq_length)
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return last_epoch_samples < int(0.80 * samples_per_epoch)


def build_doc_idx(documents, epochs, rng, separate_last):
    if separate_last and epochs > 1:
        first = build_doc_idx(documents, epochs - 1, rng, False)
        last = build_doc_idx(documents, 1, rng, False)
        return np.concatenate((first, last))
    doc_idx = np.tile(np.asarray(documents), epochs).astype(np.int32)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens_per_epoch):
    num_samples = (epochs * tokens_per_epoch - 1) // seq_length
    doc_starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=doc_starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" puts each position in the one non-empty document that holds that token.
    which = np.searchsorted(doc_starts, positions, side="right") - 1
    sample_idx = np.stack((which, positions - doc_starts[which]), axis=1)
    sample_idx[0] = 0  # Megatron's walk starts at (0, 0) even if the first document is empty
    fits_int32 = len(doc_idx) < 2**31 and (len(sizes) == 0 or sizes.max() < 2**31)
    return sample_idx.astype(np.int32 if fits_int32 else np.int64)


def build_shuffle_idx(num_samples, total_size, rng):
    """Shuffle samples [0, num_samples) and, separately, [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))
