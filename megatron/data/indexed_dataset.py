"""Megatron's mmap indexed dataset: token sequences in `{prefix}.bin`, their layout in `{prefix}.idx`.

`.idx` layout (all little-endian):
    9 bytes  magic b"MMIDIDX\\x00\\x00"
    uint64   version, 1
    uint8    dtype code of the .bin tokens (DTYPE_CODES)
    uint64   number of sequences N
    uint64   length D of the document index
    int32    sizes[N]      tokens per sequence
    int64    pointers[N]   byte offset of each sequence in .bin
    int64    doc_idx[D]    sequence index where each document starts, from 0, plus a final N
`.bin` is the sequences' tokens concatenated in that dtype.
"""
import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


class IndexFileError(ValueError):
    """A `.idx` file (or the `.bin` it describes) is missing, truncated, foreign or inconsistent."""


def data_file_path(prefix):
    return prefix + ".bin"


def index_file_path(prefix):
    return prefix + ".idx"


def best_fitting_dtype(vocab_size=None):
    """uint16 holds every token id of a vocabulary under 65,500 tokens; int32 otherwise."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def write_index(index_file, dtype, sizes, doc_idx):
    """Write a `.idx` for sequences of `sizes` tokens of `dtype` stored back to back."""
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    with open(index_file, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[np.dtype(dtype)], len(sizes), len(doc_idx)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.astype("<i8").tobytes())


class MMapIndexedDatasetBuilder:
    """Appends sequences to `out_file` (.bin); `finalize(index_file)` writes the matching .idx."""

    def __init__(self, out_file, dtype=np.int64):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no code in the indexed dataset format")
        self.out_file = out_file
        self._file = open(out_file, "wb")
        self._sizes = []
        self._doc_idx = [0]

    def add_item(self, tokens):
        """Append one sequence: a torch tensor, numpy array or list of token ids."""
        if hasattr(tokens, "numpy"):
            tokens = tokens.numpy()
        array = np.asarray(tokens)
        if array.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if array.min() < info.min or array.max() > info.max:
                raise ValueError(f"token ids {array.min()}..{array.max()} do not fit the dataset dtype {self.dtype}")
        self._file.write(array.astype(self.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
        self._sizes.append(array.size)

    def end_document(self):
        self._doc_idx.append(len(self._sizes))

    def finalize(self, index_file):
        self._file.close()
        write_index(index_file, self.dtype, self._sizes, self._doc_idx)

    def abandon(self):
        """Close and delete the partial .bin, so that a failed run leaves no half-written dataset."""
        self._file.close()
        os.remove(self.out_file)


class MMapIndexedDataset:
    """Read-only view of `{path_prefix}.bin/.idx`; items are numpy arrays over the memory map (no copy)."""

    def __init__(self, path_prefix, skip_warmup=True):
        self.path_prefix = path_prefix
        index_file = index_file_path(path_prefix)
        self.dtype, self.sizes, self.pointers, self.doc_idx = _read_index(index_file)
        data_file = data_file_path(path_prefix)
        expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if len(self.sizes) else 0
        actual = os.path.getsize(data_file) if os.path.exists(data_file) else None
        if actual != expected:
            found = "is missing" if actual is None else f"holds {actual} bytes"
            raise IndexFileError(f"{data_file} {found} but {index_file} describes {expected} bytes of {self.dtype}")
        # np.memmap cannot map an empty file; an empty dataset has nothing to read anyway.
        self._bin = np.memmap(data_file, mode="r", dtype=np.uint8) if expected else np.zeros(0, np.uint8)
        if not skip_warmup:
            _warm_up(self._bin)

    # Pickle (e.g. for spawned DataLoader workers) as the path and re-map, instead of copying the data.
    def __getstate__(self):
        return self.path_prefix

    def __setstate__(self, path_prefix):
        self.__init__(path_prefix)

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise IndexError("slices of an indexed dataset must be contiguous")
            if start >= stop:
                return []
            tokens = self._tokens(self.pointers[start], self.sizes[start:stop].sum())
            return np.split(tokens, np.cumsum(self.sizes[start:stop])[:-1])
        return self._tokens(self.pointers[idx], self.sizes[idx])

    def get(self, idx, offset=0, length=None):
        """Tokens [offset, offset + length) of sequence idx (to its end when length is None)."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {idx} of {size} tokens")
        return self._tokens(self.pointers[idx] + offset * self.dtype.itemsize, length)

    def _tokens(self, byte_offset, count):
        return np.frombuffer(self._bin, dtype=self.dtype.newbyteorder("<"), count=int(count), offset=int(byte_offset))

    @staticmethod
    def exists(path_prefix):
        return os.path.exists(index_file_path(path_prefix)) and os.path.exists(data_file_path(path_prefix))


def _read_index(index_file):
    """Parse and check a `.idx`: returns (dtype, sizes, pointers, doc_idx) as read-only memmap views."""
    if not os.path.exists(index_file):
        raise IndexFileError(f"{index_file}: no such index file")
    file_size = os.path.getsize(index_file)
    with open(index_file, "rb") as f:
        head = f.read(HEADER.size)
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise IndexFileError(f"{index_file}: not a Megatron mmap index (starts with {head[:len(MAGIC)]!r}, "
                             f"expected {MAGIC!r})")
    if len(head) < HEADER.size:
        raise IndexFileError(f"{index_file}: truncated header ({len(head)} of {HEADER.size} bytes)")
    _, version, code, count, doc_count = HEADER.unpack(head)
    if version != VERSION:
        raise IndexFileError(f"{index_file}: unsupported index version {version} (this reader knows {VERSION})")
    if code not in DTYPE_CODES:
        raise IndexFileError(f"{index_file}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    expected = HEADER.size + 4 * count + 8 * count + 8 * doc_count
    if file_size != expected:
        state = "truncated" if file_size < expected else "has trailing bytes"
        raise IndexFileError(f"{index_file}: {state}: {file_size} bytes, but its header ({count} sequences, "
                             f"{doc_count} document index entries) needs {expected}")
    buffer = np.memmap(index_file, mode="r", dtype=np.uint8)
    offset = HEADER.size
    sizes = np.frombuffer(buffer, dtype="<i4", count=count, offset=offset)
    offset += 4 * count
    pointers = np.frombuffer(buffer, dtype="<i8", count=count, offset=offset)
    offset += 8 * count
    doc_idx = np.frombuffer(buffer, dtype="<i8", count=doc_count, offset=offset)
    if doc_count == 0 or doc_idx[0] != 0 or doc_idx[-1] > count:
        raise IndexFileError(f"{index_file}: document index must start at 0 and end at most at {count}")
    return np.dtype(DTYPE_CODES[code]), sizes, pointers, doc_idx


def _warm_up(buffer, chunk=100 << 20):
    """Read the whole file once so that first training steps do not wait on disk."""
    for start in range(0, len(buffer), chunk):
        np.asarray(buffer[start:start + chunk]).sum(dtype=np.uint64)
