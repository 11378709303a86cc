"""The demo corpus (tools/demo_corpus) tokenized into an mmap indexed dataset, as the upstream scripts' --data-path."""
import json
import subprocess
import sys

from tests.helpers.launch import REPO

DEMO = REPO / "tools" / "demo_corpus"
VOCAB_FILE, MERGE_FILE = DEMO / "vocab.json", DEMO / "merges.txt"


def preprocess_demo_corpus(directory):
    """tools/preprocess_data.py over the demo corpus with its GPT-2 BPE (about a second); returns the prefix."""
    prefix = directory / "demo"
    subprocess.run([sys.executable, REPO / "tools" / "preprocess_data.py", "--input", DEMO / "docs.jsonl",
                    "--output-prefix", prefix, "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE,
                    "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "1"],
                   check=True, capture_output=True, timeout=120)
    return f"{prefix}_text_document"


def demo_documents(count=None):
    """The demo corpus's texts (real English prose), the first `count` of them."""
    with open(DEMO / "docs.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return texts[:count]


def train_sentencepiece(directory, documents, vocab_size=500):
    """A BPE SentencePiece model (LLaMA's tokenizer type) trained on `documents`; returns the .model path."""
    import sentencepiece

    prefix = directory / "tokenizer"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(documents), model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, num_threads=1, minloglevel=2)
    return str(prefix) + ".model"


def preprocess_with_sentencepiece(directory, model_file, documents, workers=1):
    """tools/preprocess_data.py over `documents` with GPTSentencePieceTokenizer; returns the completed process."""
    jsonl = directory / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents), encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(jsonl),
         "--output-prefix", str(directory / "sp"), "--tokenizer-type", "GPTSentencePieceTokenizer",
         "--tokenizer-model", model_file, "--append-eod", "--workers", str(workers)], capture_output=True, text=True)


SENTENCEPIECE_PREFIX = "sp_text_document"  # what preprocess_with_sentencepiece writes, under its directory
