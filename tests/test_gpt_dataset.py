"""GPT datasets: Megatron's --split arithmetic, samples that are exact windows of the shuffled document
stream, cached index files, and weighted blending."""
import math

import numpy as np
import pytest

from megatron.data import sample_index
from megatron.data.blendable_dataset import BlendableDataset, build_blending_indices
from megatron.data.dataset_utils import blend_num_samples, parse_blend, split_boundaries
from megatron.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder


def write_dataset(prefix, documents):
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in documents:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return MMapIndexedDataset(prefix)


def random_documents(n, seed, max_len=40, base=0):
    """Documents of random lengths (some empty) whose tokens are unique running numbers."""
    rng = np.random.RandomState(seed)
    sizes = rng.randint(0, max_len, size=n)
    sizes[[0, n // 2]] = 0
    starts = np.concatenate(([0], np.cumsum(sizes)))
    return [list(range(base + a, base + b)) for a, b in zip(starts, starts[1:])]


@pytest.mark.parametrize("splits, size, bounds", [
    ("969,30,1", 1000, [0, 969, 999, 1000]),
    ("969,30,1", 187, [0, 181, 187, 187]),
    ("80/20", 10, [0, 8, 10, 10]),
    ("1", 5, [0, 5, 5, 5]),
    ("1,1,1", 10, [0, 4, 7, 10]),  # 3 + 3 + 3 = 9: the missing document shifts every later boundary
    ("0.5,0.5", 1, [0, 1, 1, 1]),
])
def test_split_boundaries(splits, size, bounds):
    assert split_boundaries(splits, size) == bounds


def megatron_walk(sizes, doc_idx, seq_length, num_samples):
    """Sample starts found by walking the document stream token by token, as Megatron's helper does."""
    rows, doc, offset = [(0, 0)], 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining:
            length = sizes[doc_idx[doc]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                doc, offset = doc + 1, 0
        rows.append((doc, offset))
    return rows


def test_num_epochs_matches_counting_up():
    for tokens, seq, samples in [(100, 10, 9), (100, 10, 10), (5, 10, 1), (1000, 7, 0), (37, 4, 300)]:
        epochs, total = 0, 0
        while True:
            epochs, total = epochs + 1, total + tokens
            if (total - 1) // seq >= samples:
                break
        assert sample_index.num_epochs(tokens, seq, samples) == epochs
    assert sample_index.num_epochs(100, 10, 10) == 2


@pytest.mark.parametrize("num_samples, seq_length", [(20, 16), (150, 8), (97, 33)])
def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path, num_samples, seq_length):
    docs = random_documents(30, seed=num_samples)
    indexed = write_dataset(str(tmp_path / "ds"), docs)
    documents = np.arange(3, 27, dtype=np.int32)
    ds = GPTDataset("train", str(tmp_path / "ds"), documents, indexed, num_samples, seq_length, seed=1234)
    sizes = indexed.sizes
    tokens_per_epoch = int(sizes[documents].sum())
    epochs = sample_index.num_epochs(tokens_per_epoch, seq_length, num_samples)
    assert len(ds) == (epochs * tokens_per_epoch - 1) // seq_length >= num_samples
    assert sorted(ds.doc_idx.tolist()) == sorted(documents.tolist() * epochs)
    assert [tuple(r) for r in ds.sample_idx.tolist()] == megatron_walk(sizes, ds.doc_idx, seq_length, len(ds))
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    for j in range(len(ds)):
        i = int(ds.shuffle_idx[j])
        item = ds[j]["text"]
        assert item.dtype == np.int64 and item.tolist() == stream[i * seq_length:(i + 1) * seq_length + 1].tolist()
    assert sorted(ds.shuffle_idx.tolist()) == list(range(len(ds)))


def test_rng_order_and_separate_last_epoch(tmp_path):
    # 10 documents of 10 tokens, seq 9: 11 samples per epoch; 12 samples need 2 epochs and the second
    # is used for 1 sample (< 80% of 11), so it is shuffled separately, as are its samples.
    docs = [list(range(10 * d, 10 * d + 10)) for d in range(10)]
    indexed = write_dataset(str(tmp_path / "ds"), docs)
    documents = np.arange(10, dtype=np.int32)
    ds = GPTDataset("train", str(tmp_path / "ds"), documents, indexed, 12, 9, seed=7)
    rng = np.random.RandomState(7)
    first, last = documents.copy(), documents.copy()
    rng.shuffle(first)
    rng.shuffle(last)
    assert ds.doc_idx.tolist() == first.tolist() + last.tolist()
    before_last = sample_index.samples_before_last_epoch(2, 100, 9)
    assert before_last == 11 and len(ds) == 22
    head, tail = np.arange(11), np.arange(11, 22)
    rng.shuffle(head)
    rng.shuffle(tail)
    assert ds.shuffle_idx.tolist() == head.tolist() + tail.tolist()
    assert ds.shuffle_idx.dtype == np.uint32


def test_index_files_are_cached_per_configuration(tmp_path):
    prefix = str(tmp_path / "ds")
    indexed = write_dataset(prefix, random_documents(20, seed=3))
    documents = np.arange(0, 16, dtype=np.int32)
    a = GPTDataset("train", prefix, documents, indexed, 30, 8, seed=5)
    names = sorted(p.name for p in tmp_path.glob("*.npy"))
    assert names == [f"ds_train_indexmap_30ns_8sl_5s_0-16docs_{k}_idx.npy" for k in ("doc", "sample", "shuffle")]
    b = GPTDataset("train", prefix, documents, indexed, 30, 8, seed=5)
    assert isinstance(b.sample_idx, np.memmap)  # loaded from the cache, not rebuilt
    assert [b[i]["text"].tolist() for i in range(len(b))] == [a[i]["text"].tolist() for i in range(len(a))]
    GPTDataset("train", prefix, documents, indexed, 30, 16, seed=5)
    GPTDataset("train", prefix, documents, indexed, 30, 8, seed=6)
    GPTDataset("train", prefix, documents[:10], indexed, 30, 8, seed=5)
    assert len(list(tmp_path.glob("*.npy"))) == 12
    assert not list(tmp_path.glob("*.tmp*"))


def test_single_prefix_splits(tmp_path):
    prefix = str(tmp_path / "ds")
    write_dataset(prefix, random_documents(50, seed=9))
    train, valid, test = build_train_valid_test_datasets([prefix], "8,2,0", [40, 10, 0], seq_length=12, seed=1)
    assert test is None
    assert train.doc_idx.min() >= 0 and train.doc_idx.max() < 40
    assert valid.doc_idx.min() >= 40 and valid.doc_idx.max() < 50
    assert len(train) >= 40 and len(valid) >= 10
    assert train[0]["text"].shape == (13,) and valid[len(valid) - 1]["text"].shape == (13,)


def test_build_blending_indices_by_hand():
    index, sample = build_blending_indices([0.5, 0.5], 4)
    assert index.tolist() == [0, 1, 0, 1] and sample.tolist() == [0, 0, 1, 1]
    index, sample = build_blending_indices([0.25, 0.75], 4)
    assert index.tolist() == [1, 0, 1, 1] and sample.tolist() == [0, 0, 1, 2]
    index, _ = build_blending_indices([0.3, 0.7], 1000)
    assert np.bincount(index).tolist() == [300, 700]


def test_weighted_blend_of_two_prefixes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_dataset(a, random_documents(40, seed=1))
    write_dataset(b, random_documents(40, seed=2, base=30000))  # b's tokens are all >= 30000
    assert parse_blend(["1", a, "3", b]) == ([a, b], [0.25, 0.75])
    assert blend_num_samples([100, 10, 0], 0.25) == [math.ceil(25 * 1.005), math.ceil(2.5 * 1.005), 0]
    train, valid, test = build_train_valid_test_datasets(["1", a, "3", b], "9,1,0", [100, 10, 0], 10, seed=3)
    assert isinstance(train, BlendableDataset) and isinstance(valid, BlendableDataset) and test is None
    assert train.weights.tolist() == [0.25, 0.75]
    assert len(train) == sum(len(d) for d in train.datasets)
    from_b = [bool(train[i]["text"].min() >= 30000) for i in range(100)]
    assert from_b == (train.dataset_index[:100] == 1).tolist()
    assert sum(from_b) == 75
    j = int(np.flatnonzero(train.dataset_index == 1)[5])
    assert train[j]["text"].tolist() == train.datasets[1][5]["text"].tolist()


def test_empty_split_of_tokens_is_an_error(tmp_path):
    prefix = str(tmp_path / "ds")
    write_dataset(prefix, [[], [], [1, 2, 3]])
    with pytest.raises(ValueError, match="no tokens"):
        build_train_valid_test_datasets([prefix], "2,1,0", [4, 1, 0], seq_length=2, seed=1)
