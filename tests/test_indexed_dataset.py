"""Megatron's mmap .bin/.idx: our writer's bytes against the format built by hand with struct, an
independent struct-based writer read back exactly, and clear errors for damaged index files."""
import pickle
import struct

import numpy as np
import pytest
import torch

from megatron.data.indexed_dataset import (
    IndexFileError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)

STRUCT_CODES = {np.uint8: (1, "B"), np.int8: (2, "b"), np.int16: (3, "h"), np.int32: (4, "i"), np.int64: (5, "q"),
                np.float64: (6, "d"), np.float32: (7, "f"), np.uint16: (8, "H")}


def struct_index(code, sizes, pointers, doc_idx, version=1, magic=b"MMIDIDX\x00\x00"):
    n, d = len(sizes), len(doc_idx)
    return (magic + struct.pack("<Q", version) + struct.pack("<B", code) + struct.pack("<Q", n)
            + struct.pack("<Q", d) + struct.pack(f"<{n}i", *sizes) + struct.pack(f"<{n}q", *pointers)
            + struct.pack(f"<{d}q", *doc_idx))


def struct_write(prefix, dtype, documents):
    """An independent writer of the format: documents is a list of lists of sequences."""
    code, fmt = STRUCT_CODES[dtype]
    sequences = [seq for doc in documents for seq in doc]
    sizes = [len(s) for s in sequences]
    pointers = [struct.calcsize("<" + fmt) * sum(sizes[:i]) for i in range(len(sizes))]
    doc_idx = [0]
    for doc in documents:
        doc_idx.append(doc_idx[-1] + len(doc))
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(struct.pack(f"<{len(s)}{fmt}", *s))
    with open(prefix + ".idx", "wb") as f:
        f.write(struct_index(code, sizes, pointers, doc_idx))


def test_written_bytes_match_the_format(tmp_path):
    prefix = str(tmp_path / "ds")
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    builder.add_item(torch.tensor([1, 2, 3]))     # document 0: two sequences
    builder.add_item(np.array([4, 65535]))
    builder.end_document()
    builder.add_item([6])                           # document 1: one sequence
    builder.end_document()
    builder.finalize(index_file_path(prefix))
    assert (tmp_path / "ds.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 65535, 6)
    assert (tmp_path / "ds.idx").read_bytes() == (
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 3, 3)
        + struct.pack("<3i", 3, 2, 1) + struct.pack("<3q", 0, 6, 10) + struct.pack("<3q", 0, 2, 3))


def test_written_bytes_match_the_format_int32(tmp_path):
    prefix = str(tmp_path / "ds")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=best_fitting_dtype(100_000))
    builder.add_item(torch.tensor([70000, 5], dtype=torch.int64))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    assert (tmp_path / "ds.bin").read_bytes() == struct.pack("<2i", 70000, 5)
    assert (tmp_path / "ds.idx").read_bytes() == (
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 1, 2) + struct.pack("<i", 2) + struct.pack("<q", 0)
        + struct.pack("<2q", 0, 1))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8, np.float32])
def test_reads_files_of_an_independent_writer(tmp_path, dtype):
    prefix = str(tmp_path / "ds")
    documents = [[[5, 17, 250]], [[1], [2, 3, 4, 5]], [[]], [[100, 99, 98, 97, 96, 95, 94]]]
    struct_write(prefix, dtype, documents)
    ds = MMapIndexedDataset(prefix)
    sequences = [seq for doc in documents for seq in doc]
    assert len(ds) == 5 and ds.dtype == np.dtype(dtype)
    assert ds.sizes.tolist() == [3, 1, 4, 0, 7]
    assert ds.doc_idx.tolist() == [0, 1, 3, 4, 5]
    assert ds.pointers.tolist() == [np.dtype(dtype).itemsize * p for p in [0, 3, 4, 8, 8]]
    for i, seq in enumerate(sequences):
        assert ds[i].tolist() == seq and ds[i].dtype == np.dtype(dtype)
    assert [a.tolist() for a in ds[1:4]] == sequences[1:4]
    assert ds[2:2] == []
    assert ds.get(4, offset=2, length=3).tolist() == [98, 97, 96]
    assert ds.get(2, offset=1).tolist() == [3, 4, 5]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    # items are views of the memory map, not copies
    assert not ds[4].flags.owndata and not ds[4].flags.writeable


def test_warmup_and_empty_dataset(tmp_path):
    struct_write(str(tmp_path / "a"), np.uint16, [[[1, 2]], [[3]]])
    assert MMapIndexedDataset(str(tmp_path / "a"), skip_warmup=False)[1].tolist() == [3]
    struct_write(str(tmp_path / "empty"), np.uint16, [])
    assert len(MMapIndexedDataset(str(tmp_path / "empty"))) == 0
    assert MMapIndexedDataset.exists(str(tmp_path / "a")) and not MMapIndexedDataset.exists(str(tmp_path / "b"))


def test_pickles_as_its_path(tmp_path):
    struct_write(str(tmp_path / "ds"), np.int32, [[list(range(10_000))]])
    ds = MMapIndexedDataset(str(tmp_path / "ds"))
    data = pickle.dumps(ds)
    assert len(data) < 1000 and pickle.loads(data)[0].tolist() == list(range(10_000))


def test_best_fitting_dtype_and_paths():
    assert [best_fitting_dtype(v) for v in (6000, 50257, 65499, 65500, 250_000, None)] == \
        [np.uint16, np.uint16, np.uint16, np.int32, np.int32, np.int32]
    assert (data_file_path("d/x"), index_file_path("d/x")) == ("d/x.bin", "d/x.idx")


def test_builder_refuses_ids_that_do_not_fit(tmp_path):
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        builder.add_item([1, 70000])
    builder.abandon()
    assert not (tmp_path / "x.bin").exists()


GOOD = dict(code=8, sizes=[2, 1], pointers=[0, 4], doc_idx=[0, 1, 2])


@pytest.mark.parametrize("damage, message", [
    (lambda idx: idx[:-8], r"truncated: 74 bytes, but its header \(2 sequences, 3 document index entries\) needs 82"),
    (lambda idx: idx + b"\x00", "has trailing bytes"),
    (lambda idx: idx[:20], r"truncated header \(20 of 34 bytes\)"),
    (lambda idx: b"", r"truncated header \(0 of 34 bytes\)"),
    (lambda idx: b"TNTIDX\x00\x00" + idx[8:], "not a Megatron mmap index"),
    (lambda idx: b'{"json": true}', "not a Megatron mmap index"),
    (lambda idx: struct_index(**{**GOOD, "version": 2}), "unsupported index version 2"),
    (lambda idx: struct_index(**{**GOOD, "code": 9}), "unknown dtype code 9"),
    (lambda idx: struct_index(**{**GOOD, "doc_idx": [1, 2]}), "document index must start at 0"),
    (lambda idx: struct_index(**{**GOOD, "sizes": [2, 5]}), r"ds.bin holds 6 bytes but .*ds.idx describes 14 bytes"),
])
def test_damaged_index_names_file_and_problem(tmp_path, damage, message):
    prefix = str(tmp_path / "ds")
    struct_write(prefix, np.uint16, [[[1, 2]], [[3]]])
    (tmp_path / "ds.idx").write_bytes(damage((tmp_path / "ds.idx").read_bytes()))
    with pytest.raises(IndexFileError, match=message) as error:
        MMapIndexedDataset(prefix)
    assert "ds.idx" in str(error.value) and isinstance(error.value, ValueError)


def test_missing_files(tmp_path):
    with pytest.raises(IndexFileError, match="no such index file"):
        MMapIndexedDataset(str(tmp_path / "nothing"))
    struct_write(str(tmp_path / "ds"), np.uint16, [[[1, 2]]])
    (tmp_path / "ds.bin").unlink()
    with pytest.raises(IndexFileError, match=r"ds.bin is missing but .*ds.idx describes 4 bytes"):
        MMapIndexedDataset(str(tmp_path / "ds"))
