"""The demo corpus (tools/demo_corpus) tokenized into an mmap indexed dataset, as the upstream scripts' --data-path."""
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
