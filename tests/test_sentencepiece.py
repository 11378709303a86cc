"""GPTSentencePieceTokenizer (LLaMA's tokenizer) end to end: a SentencePiece model trained here on the demo
corpus (real English text), tools/preprocess_data.py with it, and the GPT dataset reading the result back:
every token is the one `sentencepiece` itself produces."""
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import sentencepiece

from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import GPTSentencePieceTokenizer, build_tokenizer
from tests.helpers.corpus import (
    SENTENCEPIECE_PREFIX,
    demo_documents,
    preprocess_with_sentencepiece,
    train_sentencepiece,
)

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tools" / "demo_corpus" / "docs.jsonl"  # real English prose
VOCAB = 500
SEQ = 32


@pytest.fixture(scope="module")
def documents():
    return demo_documents(40)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, documents):
    return train_sentencepiece(tmp_path_factory.mktemp("spm"), documents, vocab_size=VOCAB)


def test_tokenizer_matches_sentencepiece(model_file, documents):
    reference = sentencepiece.SentencePieceProcessor(model_file=model_file)
    args = Namespace(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model_file,
                     make_vocab_size_divisible_by=128, tensor_model_parallel_size=2, rank=1)
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, GPTSentencePieceTokenizer)
    assert tokenizer.vocab_size == VOCAB and args.padded_vocab_size == 512  # a multiple of 128 x tp 2
    assert tokenizer.eod == reference.eos_id()
    for text in documents[:10]:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text)
        assert tokenizer.detokenize(ids) == reference.decode(ids)


def test_preprocess_and_dataset_hold_sentencepiece_tokens(tmp_path, model_file, documents):
    reference = sentencepiece.SentencePieceProcessor(model_file=model_file)
    expected = [reference.encode(text) + [reference.eos_id()] for text in documents]
    run = preprocess_with_sentencepiece(tmp_path, model_file, documents, workers=2)
    assert run.returncode == 0, run.stderr
    prefix = str(tmp_path / SENTENCEPIECE_PREFIX)
    indexed = MMapIndexedDataset(prefix)
    assert [indexed[i].tolist() for i in range(len(indexed))] == expected

    # A sample is seq+1 tokens across the documents in the dataset's shuffled order: cut after each
    # end-of-document token, every piece is a run of one document's tokens.
    train, _, _ = build_train_valid_test_datasets([prefix], "100,0,0", [8, 0, 0], SEQ, seed=1234)
    spelled = [" " + " ".join(map(str, tokens)) + " " for tokens in expected]
    eod = reference.eos_id()
    assert len(train) >= 8
    for i in range(len(train)):
        sample = train[i]["text"].tolist()
        assert len(sample) == SEQ + 1
        pieces, piece = [], []
        for token in sample:
            piece.append(token)
            if token == eod:
                pieces.append(piece)
                piece = []
        pieces += [piece] if piece else []
        for piece in pieces:
            text = " " + " ".join(map(str, piece)) + " "
            assert any(text in document for document in spelled), (i, piece)


def test_missing_model_is_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(CORPUS),
         "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "GPTSentencePieceTokenizer"],
        capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip() == "error: cannot build the tokenizer: GPTSentencePieceTokenizer needs --tokenizer-model"
