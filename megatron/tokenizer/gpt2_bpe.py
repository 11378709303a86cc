"""GPT-2 byte-level BPE: UTF-8 bytes shown as printable characters, split by GPT-2's regex, merged by rank."""
import json

import regex

# GPT-2's pre-tokenisation: contractions, letter runs, digit runs and punctuation runs (each may carry one
# leading space), then whitespace, keeping the last space of a run for the word that follows it.
GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

# The BPE cache is per pre-token ("word"); it is cleared when it reaches this many entries so that tokenising a
# corpus with an unbounded number of distinct words keeps a bounded memory footprint.
CACHE_LIMIT = 500_000


def bytes_to_unicode():
    """GPT-2's byte -> character table: printable Latin-1 bytes map to themselves, the other 68 bytes
    to the characters from U+0100 on, in byte order. Returned as a list of 256 (byte, char) pairs in
    GPT-2's order (printable bytes first), which is also the order of the 256 base tokens of a vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    printable_set = set(printable)
    others = [b for b in range(256) if b not in printable_set]
    return [(b, chr(b)) for b in printable] + [(b, chr(256 + i)) for i, b in enumerate(others)]


def merge_pair(parts, left, right):
    """`parts` with every adjacent (left, right) joined into one symbol, left to right."""
    merged, i = [], 0
    while i < len(parts):
        if i + 1 < len(parts) and parts[i] == left and parts[i + 1] == right:
            merged.append(left + right)
            i += 2
        else:
            merged.append(parts[i])
            i += 1
    return merged


def read_vocab(vocab_file):
    with open(vocab_file, encoding="utf-8") as f:
        return json.load(f)


def read_merges(merge_file):
    """merges.txt: an optional '#version' first line, then one 'left right' pair per line."""
    with open(merge_file, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    return [tuple(line.split(" ")) for line in lines if line]


class ByteLevelBPE:
    """Encodes text to ids and back with a GPT-2-format vocab (token string -> id) and merge list."""

    def __init__(self, vocab, merges):
        self.encoder = dict(vocab)
        self.decoder = {i: token for token, i in self.encoder.items()}
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        table = bytes_to_unicode()
        self.byte_table = str.maketrans({chr(b): c for b, c in table})
        self.inverse_byte_table = str.maketrans({c: chr(b) for b, c in table})
        self.cache = {}  # pre-token text -> ids

    def bpe(self, word):
        """Merge the characters of one byte-level word, lowest-ranked adjacent pair first, into vocab ids."""
        parts = list(word)
        ranks = self.bpe_ranks
        while len(parts) > 1:
            best, best_rank = None, None
            for pair in zip(parts, parts[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = pair, rank
            if best is None:
                break
            parts = merge_pair(parts, *best)
        return [self.encoder[p] for p in parts]

    def encode(self, text):
        cache, ids = self.cache, []
        for piece in GPT2_PATTERN.findall(text):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                # UTF-8 bytes -> one Latin-1 character each -> GPT-2's printable stand-ins
                piece_ids = self.bpe(piece.encode("utf-8").decode("latin-1").translate(self.byte_table))
                if len(cache) >= CACHE_LIMIT:
                    cache.clear()
                cache[piece] = piece_ids
            ids.extend(piece_ids)
        return ids

    def decode(self, ids):
        # A slice of ids may end inside a multi-byte character: show it as U+FFFD rather than fail.
        text = "".join(self.decoder[i] for i in ids).translate(self.inverse_byte_table)
        return text.encode("latin-1").decode("utf-8", errors="replace")
