"""GPT pre-training datasets: fixed-length samples cut from a shuffled stream of documents.

Index files are cached beside the data as
    {prefix}_{split}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_{first}-{end}docs_{doc,sample,shuffle}_idx.npy
and are loaded when present. Building them is deterministic and each file is written to a temporary
name and renamed into place, so a reader never sees a partial file. Expected use in a distributed job
(this module calls no collectives): global rank 0 calls build_train_valid_test_datasets first, then
all ranks pass a barrier, then the other ranks call it and load what rank 0 cached. Regenerating the
data under the same prefix requires deleting its *_indexmap_* files.
"""
import os
import time

import numpy as np
import torch

from . import sample_index
from .blendable_dataset import BlendableDataset
from .dataset_utils import blend_num_samples, parse_blend, print_rank_0, split_boundaries
from .indexed_dataset import MMapIndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def build_train_valid_test_datasets(data_prefix, splits_string, train_valid_test_num_samples, seq_length, seed,
                                    skip_warmup=True, cache_dir=None):
    """data_prefix: [prefix] or [w1, prefix1, w2, prefix2, ...]. Returns (train, valid, test); a split
    with no documents is None. cache_dir (--data-cache-path): where the index files go instead of beside
    the data."""
    if len(data_prefix) == 1:
        return _build_for_prefix(data_prefix[0], splits_string, train_valid_test_num_samples, seq_length, seed,
                                 skip_warmup, cache_dir)
    prefixes, weights = parse_blend(data_prefix)
    per_prefix = [
        _build_for_prefix(prefix, splits_string, blend_num_samples(train_valid_test_num_samples, weight),
                          seq_length, seed, skip_warmup, cache_dir)
        for prefix, weight in zip(prefixes, weights)
    ]
    blends = []
    for split in range(len(SPLIT_NAMES)):
        present = [(datasets[split], w) for datasets, w in zip(per_prefix, weights) if datasets[split] is not None]
        blends.append(BlendableDataset([d for d, _ in present], [w for _, w in present]) if present else None)
    return tuple(blends)


def _build_for_prefix(prefix, splits_string, num_samples, seq_length, seed, skip_warmup, cache_dir):
    indexed = MMapIndexedDataset(prefix, skip_warmup=skip_warmup)
    bounds = split_boundaries(splits_string, len(indexed))
    print_rank_0(f" > {prefix}: {len(indexed)} documents, split {splits_string} -> "
                 + ", ".join(f"{name} [{bounds[i]}, {bounds[i + 1]})" for i, name in enumerate(SPLIT_NAMES)))
    datasets = []
    for i, name in enumerate(SPLIT_NAMES):
        if bounds[i + 1] > bounds[i]:
            documents = np.arange(bounds[i], bounds[i + 1], dtype=np.int32)
            datasets.append(GPTDataset(name, prefix, documents, indexed, num_samples[i], seq_length, seed,
                                       cache_dir))
        else:
            datasets.append(None)
    return tuple(datasets)


class GPTDataset(torch.utils.data.Dataset):
    """Samples of seq_length + 1 tokens (inputs and shifted labels) over `documents` of an indexed dataset."""

    def __init__(self, name, data_prefix, documents, indexed_dataset, num_samples, seq_length, seed, cache_dir=None):
        if len(documents) == 0 or documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise ValueError(f"{name}: documents must be a non-empty range within the {len(indexed_dataset)} "
                             f"documents of {data_prefix}")
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.doc_idx, self.sample_idx, self.shuffle_idx = _index_mappings(
            name, data_prefix, documents, indexed_dataset.sizes, num_samples, seq_length, seed, cache_dir)

    def __len__(self):
        # sample i runs from sample_idx[i] to sample_idx[i + 1], hence one fewer sample than rows
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx):
        idx = self.shuffle_idx[idx]
        first_doc, first_offset = (int(x) for x in self.sample_idx[idx])
        last_doc, last_offset = (int(x) for x in self.sample_idx[idx + 1])
        get = self.indexed_dataset.get
        if first_doc == last_doc:
            tokens = get(self.doc_idx[first_doc], offset=first_offset, length=last_offset - first_offset + 1)
        else:
            parts = [get(self.doc_idx[first_doc], offset=first_offset)]
            parts += [get(self.doc_idx[d]) for d in range(first_doc + 1, last_doc)]
            parts.append(get(self.doc_idx[last_doc], length=last_offset + 1))
            tokens = np.concatenate(parts)
        return {"text": np.array(tokens, dtype=np.int64)}


def index_file_stem(data_prefix, name, documents, num_samples, seq_length, seed, cache_dir=None):
    base = os.path.join(cache_dir, os.path.basename(data_prefix)) if cache_dir else data_prefix
    return (f"{base}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_"
            f"{int(documents[0])}-{int(documents[-1]) + 1}docs")


def _index_mappings(name, data_prefix, documents, sizes, num_samples, seq_length, seed, cache_dir):
    stem = index_file_stem(data_prefix, name, documents, num_samples, seq_length, seed, cache_dir)
    paths = [f"{stem}_{kind}_idx.npy" for kind in ("doc", "sample", "shuffle")]
    if all(os.path.exists(p) for p in paths):
        print_rank_0(f" > {name}: loading cached indices {stem}_*_idx.npy")
        return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)

    start = time.time()
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    epochs = sample_index.num_epochs(tokens_per_epoch, seq_length, num_samples)
    separate_last = sample_index.separate_last_epoch(epochs, tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    doc_idx = sample_index.build_doc_idx(documents, epochs, rng, separate_last)
    sample_idx = sample_index.build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    # with a separate last epoch, its samples are shuffled apart from the earlier epochs' samples
    first_shuffle_size = (sample_index.samples_before_last_epoch(epochs, tokens_per_epoch, seq_length)
                          if separate_last else total)
    shuffle_idx = sample_index.build_shuffle_idx(first_shuffle_size, total, rng)
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    for path, array in zip(paths, (doc_idx, sample_idx, shuffle_idx)):
        _save_atomically(path, array)
    print_rank_0(f" > {name}: built indices for {total} samples ({epochs} epochs of {tokens_per_epoch} tokens, "
                 f"separate last epoch: {separate_last}) in {time.time() - start:.2f} s -> {stem}_*_idx.npy")
    return doc_idx, sample_idx, shuffle_idx


def _save_atomically(path, array):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)
