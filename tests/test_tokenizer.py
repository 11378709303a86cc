"""GPT-2 byte-level BPE: exact ids on a hand-built vocab, equality with the `tokenizers` library on a
multi-MB real text, round trips, and Megatron's padded vocabulary size."""
import glob
import json
import os
import random
import subprocess
import sys
import sysconfig
from argparse import Namespace
from pathlib import Path

import pytest
import tokenizers  # test dependency (setup.py extras "test")

from megatron.tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.tokenizer.gpt2_bpe import bytes_to_unicode

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "tools" / "demo_corpus"

# Strings that exercise the pre-tokeniser: contractions, digit runs, whitespace runs, non-Latin
# scripts, combining marks, emoji with joiners, control characters and the end-of-text marker as text.
TRICKY = (
    "I'm sure they'll say it's 2024's best—isn't it? We've 12345 items & 3.14 pies!!\n\n\n"
    "   leading spaces\ttabs\t\tand trailing spaces   \r\nWindows line\r\n"
    "naïve café, Ærøskøbing, Straße, İstanbul, ÿ\u00a0non-breaking\u2003em space\n"
    "日本語のテキストと中文文本, 한국어, العربية, עברית, русский текст, ελληνικά\n"
    "e\u0301 combining, emoji 👩‍👩‍👧‍👦 🇩🇪 🤖🤖, math ∑∫√∞ ≤≥, \x00\x07\x1b control\n"
    "<|endoftext|> is plain text here'S 'LL 'd\u200bzero-width"
)


def args_for(vocab_file, merge_file, divisible_by=128, tp=1, rank=0):
    return Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab_file), merge_file=str(merge_file),
                     make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tp, rank=rank)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return build_tokenizer(args_for(DEMO / "vocab.json", DEMO / "merges.txt"))


def real_text(min_bytes=3_000_000):
    """Real English text every CPython machine has: the Language Reference shipped in pydoc_data,
    the licence texts Debian ships (when present), then standard-library sources, in a fixed order."""
    from pydoc_data.topics import topics

    parts = [topics[k] for k in sorted(topics)]
    parts += [Path(p).read_text(encoding="utf-8") for p in sorted(glob.glob("/usr/share/common-licenses/*"))
              if os.path.isfile(p)]
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if sum(len(p) for p in parts) >= min_bytes:
            break
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
    parts.append(TRICKY)
    text = "\n".join(parts)
    assert len(text.encode("utf-8")) >= min_bytes
    return text


@pytest.fixture(scope="module")
def reference():
    """The `tokenizers` library's byte-level BPE on the same files, configured as GPT-2."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(DEMO / "vocab.json"), str(DEMO / "merges.txt")))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tok


def test_same_ids_as_tokenizers_library_on_multi_mb_text(demo_tokenizer, reference):
    text = real_text()
    ours = demo_tokenizer.tokenize(text)
    assert ours == reference.encode(text).ids
    assert demo_tokenizer.detokenize(ours) == text


def tiny_vocab_files(tmp_path):
    """256 byte tokens in GPT-2's order, four merges, then <|endoftext|>."""
    vocab = {char: i for i, (_, char) in enumerate(bytes_to_unicode())}
    merges = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("l", "l")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                         encoding="utf-8")
    return tmp_path / "vocab.json", tmp_path / "merges.txt"


def test_hand_computed_ids(tmp_path):
    tok = build_tokenizer(args_for(*tiny_vocab_files(tmp_path)))
    # Byte tokens: '!'..'~' are ids 0..93 (id = ord - 33); the space byte is 'Ġ', id 220 as in GPT-2.
    # "hello": he (rank 0) then ll (rank 3) -> [he, ll, o]; " the": he, Ġt, then Ġt+he -> [Ġthe].
    assert tok.tokenize("hello the world") == [256, 259, ord("o") - 33, 258,
                                               220, ord("w") - 33, ord("o") - 33, ord("r") - 33, ord("l") - 33,
                                               ord("d") - 33]
    assert tok.vocab_size == 261 and tok.eod == 260
    # <|endoftext|> inside text is ordinary text, as in Megatron's GPT-2 tokenizer
    assert tok.eod not in tok.tokenize("<|endoftext|>")
    # 'é' is the two bytes C3 A9; half of it decodes to U+FFFD instead of failing
    ids = tok.tokenize("é")
    assert ids == [bytes_to_unicode_id(0xC3), bytes_to_unicode_id(0xA9)]
    assert tok.detokenize(ids[:1]) == "\ufffd" and tok.detokenize(ids) == "é"


def bytes_to_unicode_id(byte):
    return [b for b, _ in bytes_to_unicode()].index(byte)


def test_any_utf8_text_round_trips(demo_tokenizer, reference):
    rng = random.Random(0)
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    for _ in range(300):
        text = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(0, 40)))
        ids = demo_tokenizer.tokenize(text)
        assert demo_tokenizer.detokenize(ids) == text
        assert ids == reference.encode(text).ids
    assert demo_tokenizer.tokenize("") == []


def test_bpe_results_are_cached_per_word(demo_tokenizer):
    demo_tokenizer.bpe.cache.clear()
    ids = demo_tokenizer.tokenize("lambda lambda")
    assert set(demo_tokenizer.bpe.cache) == {"lambda", " lambda"}
    assert demo_tokenizer.tokenize("lambda lambda") == ids


@pytest.mark.parametrize("orig, divisible_by, tp, padded", [
    (6000, 128, 1, 6016), (6000, 128, 2, 6144), (50257, 128, 1, 50304), (50257, 128, 8, 51200),
    (256, 128, 2, 256), (6000, 1, 1, 6000),
])
def test_padded_vocab_size(orig, divisible_by, tp, padded):
    args = Namespace(make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tp, rank=1)
    assert vocab_size_with_padding(orig, args) == padded


def test_build_tokenizer_sets_padded_size_and_prints_on_rank_0_only(capsys):
    args = args_for(DEMO / "vocab.json", DEMO / "merges.txt", tp=2)
    tok = build_tokenizer(args)
    assert (tok.vocab_size, tok.eod, args.padded_vocab_size) == (6000, 5999, 6144)
    assert "(new size: 6144)" in capsys.readouterr().out
    build_tokenizer(args_for(DEMO / "vocab.json", DEMO / "merges.txt", rank=1))
    assert capsys.readouterr().out == ""
    with pytest.raises(NotImplementedError, match="BertWordPieceLowerCase"):
        build_tokenizer(Namespace(**{**vars(args), "tokenizer_type": "BertWordPieceLowerCase"}))


def test_committed_vocab_is_what_train_bpe_makes(tmp_path):
    subprocess.run([sys.executable, str(DEMO / "train_bpe.py"), "--vocab-size", "6000", "--output-dir", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("vocab.json", "merges.txt"):
        assert (tmp_path / name).read_bytes() == (DEMO / name).read_bytes()
