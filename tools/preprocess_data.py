"""Tokenise a jsonl corpus into Megatron's mmap indexed dataset.

Each input line is a JSON object; the text under each --json-keys key becomes one document of
{output_prefix}_{key}_document.bin/.idx. Blank lines are ignored. A line that is not a JSON object
or lacks a key stops the run with exit status 2 (no .idx is written and the partial .bin is removed),
unless --skip-bad-lines is given, in which case such lines are skipped and counted.

    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/demo \
        --vocab-file vocab.json --merge-file merges.txt --tokenizer-type GPT2BPETokenizer \
        --append-eod --workers 2

A SentencePiece model (LLaMA's tokenizer) instead: --tokenizer-type GPTSentencePieceTokenizer
--tokenizer-model tokenizer.model.
"""
import argparse
import json
import multiprocessing
import os
import sys
import time

# A script of this checkout: our `megatron` is imported from the checkout root (the parent of tools/), since the
# project installs only `patches` (an installed `megatron` would clash with the user's Megatron-DeepSpeed).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.tokenizer import TOKENIZER_TYPES

CHUNK_SIZE = 64  # lines per task handed to a worker: amortises inter-process traffic
MAX_REPORTED_BAD_LINES = 10


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="Tokenise a jsonl corpus into Megatron's indexed dataset.")
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text to tokenise")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip lines that are not JSON objects or lack a key (default: stop with exit 2)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=list(TOKENIZER_TYPES))
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    group.add_argument("--tokenizer-model", default=None, help="GPTSentencePieceTokenizer's SentencePiece model")
    group.add_argument("--append-eod", action="store_true",
                       help="end every document with the tokenizer's end-of-document token")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True)
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"])
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenising processes")
    group.add_argument("--log-interval", type=int, default=1000, help="print progress every this many documents")
    args = parser.parse_args(argv)
    # build_tokenizer's view of a single-process, non-parallel job
    args.rank = 0
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    return args


def json_type(value):
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null")


class LineEncoder:
    """Turns one raw jsonl line into token arrays per key, or an error message."""

    def __init__(self, tokenizer, json_keys, append_eod, dtype):
        self.tokenizer, self.json_keys, self.append_eod, self.dtype = tokenizer, json_keys, append_eod, dtype

    def __call__(self, numbered_line):
        line_no, raw = numbered_line
        try:
            doc = json.loads(raw)
        except ValueError as e:
            return line_no, len(raw), None, f"not valid JSON ({e})"
        if not isinstance(doc, dict):
            return line_no, len(raw), None, f"a JSON {json_type(doc)}, not an object"
        tokens = {}
        for key in self.json_keys:
            if key not in doc:
                return line_no, len(raw), None, f"no {key!r} key"
            text = doc[key]
            if not isinstance(text, str):
                return line_no, len(raw), None, f"{key!r} holds a JSON {json_type(text)}, not a string"
            ids = self.tokenizer.tokenize(text)
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            tokens[key] = np.array(ids, dtype=self.dtype)
        return line_no, len(raw), tokens, None


_worker_encoder = None


def _init_worker(encoder):
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(numbered_line):
    return _worker_encoder(numbered_line)


def numbered_lines(f):
    return ((n, line) for n, line in enumerate(f, start=1) if line.strip())


class Progress:
    def __init__(self, log_interval):
        self.log_interval, self.start, self.docs, self.bytes, self.tokens = log_interval, time.time(), 0, 0, 0

    def add(self, nbytes, ntokens):
        self.docs += 1
        self.bytes += nbytes
        self.tokens += ntokens
        if self.docs % self.log_interval == 0:
            print(f"Processed {self.docs} documents ({self.rates()}).", file=sys.stderr, flush=True)

    def rates(self):
        elapsed = max(time.time() - self.start, 1e-9)
        return f"{self.docs / elapsed:.1f} docs/s, {self.bytes / elapsed / 1e6:.2f} MB/s"


def main(argv=None):
    args = get_args(argv)
    try:
        tokenizer = build_tokenizer(args)
    except (OSError, ValueError) as e:
        print(f"error: cannot build the tokenizer: {e}", file=sys.stderr)
        return 2
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    encoder = LineEncoder(tokenizer, args.json_keys, args.append_eod, dtype)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    builders = {key: MMapIndexedDatasetBuilder(prefix + ".bin", dtype) for key, prefix in prefixes.items()}

    progress = Progress(args.log_interval)
    bad_lines = 0
    pool = multiprocessing.Pool(args.workers, _init_worker, (encoder,)) if args.workers > 1 else None
    with open(args.input, "rb") as f:
        lines = numbered_lines(f)
        results = pool.imap(_encode_in_worker, lines, CHUNK_SIZE) if pool else map(encoder, lines)
        for line_no, nbytes, tokens, error in results:
            if error is not None:
                bad_lines += 1
                if not args.skip_bad_lines:
                    print(f"error: {args.input}:{line_no}: {error}; stopping (use --skip-bad-lines to skip such "
                          f"lines)", file=sys.stderr)
                    if pool:
                        pool.terminate()
                    for builder in builders.values():
                        builder.abandon()
                    return 2
                if bad_lines <= MAX_REPORTED_BAD_LINES:
                    print(f"warning: {args.input}:{line_no}: {error}; skipped", file=sys.stderr)
                continue
            for key, ids in tokens.items():
                if len(ids):
                    builders[key].add_item(ids)
                    builders[key].end_document()
            progress.add(nbytes, sum(len(ids) for ids in tokens.values()))
    if pool:
        pool.close()
        pool.join()
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")
    print(f"Done: {progress.docs} documents, {progress.tokens} tokens, {progress.bytes / 1e6:.2f} MB in "
          f"{time.time() - progress.start:.2f} s ({progress.rates()}) with {args.workers} worker(s); "
          f"skipped {bad_lines} bad lines; wrote " + ", ".join(p + ".bin/.idx" for p in prefixes.values()),
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
