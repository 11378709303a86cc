"""Megatron's tokenizer entry point: build_tokenizer(args) and the padded vocabulary size."""
from .gpt2_bpe import ByteLevelBPE, read_merges, read_vocab

END_OF_TEXT = "<|endoftext|>"


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE with <|endoftext|> as the end-of-document token."""

    def __init__(self, vocab_file, merge_file):
        vocab = read_vocab(vocab_file)
        if END_OF_TEXT not in vocab:
            raise ValueError(f"{vocab_file} has no {END_OF_TEXT} token, which GPT-2 uses to end documents")
        self.bpe = ByteLevelBPE(vocab, read_merges(merge_file))
        self.eod = vocab[END_OF_TEXT]

    @property
    def vocab_size(self):
        return len(self.bpe.encoder)

    @property
    def vocab(self):
        return self.bpe.encoder

    @property
    def inv_vocab(self):
        return self.bpe.decoder

    def tokenize(self, text):
        return self.bpe.encode(text)

    def detokenize(self, ids):
        return self.bpe.decode(ids)


def vocab_size_with_padding(orig_vocab_size, args):
    """Round the vocabulary up so each tensor-parallel shard of the embedding is a multiple of
    make_vocab_size_divisible_by rows."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    padded = -(-orig_vocab_size // multiple) * multiple
    if getattr(args, "rank", 0) == 0:
        print(f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} dummy tokens "
              f"(new size: {padded})", flush=True)
    return padded


def build_tokenizer(args):
    """Build the tokenizer named by args.tokenizer_type and set args.padded_vocab_size."""
    if getattr(args, "rank", 0) == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    if args.tokenizer_type != "GPT2BPETokenizer":
        raise NotImplementedError(f"tokenizer type {args.tokenizer_type!r} is not supported; use GPT2BPETokenizer")
    if args.vocab_file is None or args.merge_file is None:
        raise ValueError("GPT2BPETokenizer needs both --vocab-file and --merge-file")
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
    args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer
