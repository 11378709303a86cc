"""tools/preprocess_data.py end to end: tokens read back from the written dataset, identical output
with several workers, bad lines reported with their line number, progress and throughput printed."""
import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "tools" / "demo_corpus"
DOCS = [
    {"text": "The \"if\" statement is used for conditional execution.", "title": "if"},
    {"text": "", "title": "an empty text makes no document"},
    {"text": "naïve café — 日本語 🤖\n\n  spaced  out\n", "title": "unicode"},
    {"text": "x" * 5000, "title": "long"},
    {"text": "Short.", "title": "last"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(DEMO / "vocab.json"),
                                     merge_file=str(DEMO / "merges.txt"), make_vocab_size_divisible_by=128,
                                     tensor_model_parallel_size=1, rank=1))


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def preprocess(input_path, prefix, *extra):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(input_path),
         "--output-prefix", str(prefix), "--vocab-file", str(DEMO / "vocab.json"), "--merge-file",
         str(DEMO / "merges.txt"), "--tokenizer-type", "GPT2BPETokenizer", *extra],
        capture_output=True, text=True)


def test_tokens_read_back_per_key(tmp_path, tokenizer):
    jsonl = write_jsonl(tmp_path / "in.jsonl", [json.dumps(d, ensure_ascii=False) for d in DOCS] + [""])
    run = preprocess(jsonl, tmp_path / "out", "--json-keys", "text", "title", "--append-eod", "--log-interval", "2")
    assert run.returncode == 0, run.stderr
    for key in ("text", "title"):
        ds = MMapIndexedDataset(str(tmp_path / f"out_{key}_document"))
        expected = [tokenizer.tokenize(d[key]) + [tokenizer.eod] for d in DOCS if d[key]]
        assert [ds[i].tolist() for i in range(len(ds))] == expected
        assert ds.dtype == np.uint16 and ds.doc_idx.tolist() == list(range(len(expected) + 1))
    assert "Processed 2 documents (" in run.stderr and "Processed 4 documents (" in run.stderr
    assert "docs/s" in run.stderr and "MB/s" in run.stderr
    assert "Done: 5 documents" in run.stderr and "skipped 0 bad lines" in run.stderr


def test_two_workers_write_identical_files(tmp_path):
    jsonl = DEMO / "docs.jsonl"
    assert preprocess(jsonl, tmp_path / "one", "--append-eod").returncode == 0
    assert preprocess(jsonl, tmp_path / "two", "--append-eod", "--workers", "2").returncode == 0
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{ext}").read_bytes()
        assert one == (tmp_path / f"two_text_document{ext}").read_bytes()
    assert len(MMapIndexedDataset(str(tmp_path / "one_text_document"))) == 187


def test_without_append_eod(tmp_path, tokenizer):
    jsonl = write_jsonl(tmp_path / "in.jsonl", [json.dumps(DOCS[0])])
    assert preprocess(jsonl, tmp_path / "out").returncode == 0
    assert MMapIndexedDataset(str(tmp_path / "out_text_document"))[0].tolist() == tokenizer.tokenize(DOCS[0]["text"])


BAD_LINES = [json.dumps(DOCS[0]), json.dumps(DOCS[2]), "{not json", json.dumps({"title": "no text"}),
             json.dumps(["a", "list"]), json.dumps({"text": 42}), json.dumps(DOCS[4])]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_line_stops_with_exit_2_and_no_output(tmp_path, workers):
    jsonl = write_jsonl(tmp_path / "in.jsonl", BAD_LINES)
    run = preprocess(jsonl, tmp_path / "out", "--workers", workers)
    assert run.returncode == 2
    assert f"{jsonl}:3: not valid JSON" in run.stderr
    assert not list(tmp_path.glob("out_*"))


def test_skip_bad_lines_reports_each_and_the_count(tmp_path, tokenizer):
    jsonl = write_jsonl(tmp_path / "in.jsonl", BAD_LINES)
    run = preprocess(jsonl, tmp_path / "out", "--skip-bad-lines", "--append-eod")
    assert run.returncode == 0, run.stderr
    for line, problem in [(3, "not valid JSON"), (4, "no 'text' key"), (5, "a JSON array, not an object"),
                          (6, "'text' holds a JSON number, not a string")]:
        assert f"{jsonl}:{line}: {problem}" in run.stderr
    assert "Done: 3 documents" in run.stderr and "skipped 4 bad lines" in run.stderr
    ds = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(3)] == [tokenizer.tokenize(DOCS[i]["text"]) + [tokenizer.eod]
                                                  for i in (0, 2, 4)]


def test_missing_vocab_file_exits_2(tmp_path):
    jsonl = write_jsonl(tmp_path / "in.jsonl", [json.dumps(DOCS[0])])
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(jsonl),
                          "--output-prefix", str(tmp_path / "out"), "--vocab-file", str(tmp_path / "none.json"),
                          "--merge-file", str(DEMO / "merges.txt")], capture_output=True, text=True)
    assert run.returncode == 2 and "none.json" in run.stderr
