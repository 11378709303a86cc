"""Train the demo's GPT-2-format byte-level BPE vocabulary on docs.jsonl.

How vocab.json / merges.txt were made (from the repository root):
    python tools/demo_corpus/make_corpus.py
    python tools/demo_corpus/train_bpe.py --vocab-size 6000
The text is split with GPT-2's pre-tokenisation regex, each piece becomes UTF-8 bytes in GPT-2's
byte-to-character alphabet, and the most frequent adjacent pair (ties: the smaller pair in string
order) is merged until the vocabulary holds --vocab-size tokens: the 256 byte tokens, one per merge,
and <|endoftext|> last, as in GPT-2's own files. The run is deterministic.
"""
import argparse
import collections
import heapq
import json
import os
import sys

# A script of this checkout: our `megatron` is imported from the checkout root (two folders up), since the
# project installs only `patches` (an installed `megatron` would clash with the user's Megatron-DeepSpeed).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megatron.tokenizer.gpt2_bpe import GPT2_PATTERN, bytes_to_unicode, merge_pair

HERE = os.path.dirname(os.path.abspath(__file__))
END_OF_TEXT = "<|endoftext|>"


def word_counts(texts):
    byte_encoder = dict(bytes_to_unicode())
    counts = collections.Counter()
    for text in texts:
        for piece in GPT2_PATTERN.findall(text):
            counts["".join(byte_encoder[b] for b in piece.encode("utf-8"))] += 1
    return counts


class PairCounter:
    """Pair frequencies over a set of weighted words, updated incrementally as pairs are merged."""

    def __init__(self, counts):
        self.words = [list(w) for w in counts]
        self.freqs = list(counts.values())
        self.count = collections.Counter()
        self.where = collections.defaultdict(set)  # pair -> indices of the words that contain it
        for i, word in enumerate(self.words):
            self._add(i, word, +1)
        self.heap = [(-c, pair) for pair, c in self.count.items()]
        heapq.heapify(self.heap)

    def _add(self, i, word, sign):
        for pair in zip(word, word[1:]):
            self.count[pair] += sign * self.freqs[i]
            if sign > 0:
                self.where[pair].add(i)

    def most_frequent(self):
        # The heap holds stale entries too: skip any whose count is no longer current.
        while self.heap:
            neg, pair = heapq.heappop(self.heap)
            if self.count.get(pair, 0) == -neg and -neg > 0:
                return pair, -neg
        return None, 0

    def merge(self, pair):
        left, right = pair
        touched = set()
        for i in self.where.pop(pair):
            word = self.words[i]
            self._add(i, word, -1)
            touched.update(zip(word, word[1:]))
            merged = merge_pair(word, left, right)
            self.words[i] = merged
            self._add(i, merged, +1)
            touched.update(zip(merged, merged[1:]))
        for p in touched:
            if self.count[p] > 0:
                heapq.heappush(self.heap, (-self.count[p], p))
            else:
                self.count.pop(p)
                self.where.pop(p, None)


def train(texts, vocab_size):
    vocab = {char: i for i, (_, char) in enumerate(bytes_to_unicode())}
    merges = []
    pairs = PairCounter(word_counts(texts))
    while len(vocab) < vocab_size - 1:
        pair, count = pairs.most_frequent()
        if count < 2:
            break
        pairs.merge(pair)
        merges.append(pair)
        vocab.setdefault(pair[0] + pair[1], len(vocab))
    vocab[END_OF_TEXT] = len(vocab)
    return vocab, merges


def main():
    parser = argparse.ArgumentParser(description="Train a GPT-2-format byte-level BPE on a jsonl corpus.")
    parser.add_argument("--input", default=os.path.join(HERE, "docs.jsonl"))
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--vocab-size", type=int, default=6000, help="including 256 byte tokens and <|endoftext|>")
    parser.add_argument("--output-dir", default=HERE)
    args = parser.parse_args()
    with open(args.input, encoding="utf-8") as f:
        texts = [json.loads(line)[args.json_key] for line in f if line.strip()]
    vocab, merges = train(texts, args.vocab_size)
    with open(os.path.join(args.output_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(args.output_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    print(f"{len(texts)} documents -> {len(merges)} merges, vocabulary of {len(vocab)} tokens in {args.output_dir}")


if __name__ == "__main__":
    main()
