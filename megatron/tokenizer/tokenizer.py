"""Megatron's tokenizer entry point: build_tokenizer(args) and the padded vocabulary size."""
import os

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


class GPTSentencePieceTokenizer:
    """A SentencePiece model (LLaMA's tokenizer) used as upstream does: plain pieces, no BOS added,
    the model's end-of-sentence id ends documents."""

    def __init__(self, model_file):
        try:
            import sentencepiece
        except ImportError as error:
            raise ImportError("GPTSentencePieceTokenizer needs the sentencepiece package (pip install sentencepiece)") \
                from error
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.eod = self.processor.eos_id()
        if self.eod < 0:
            raise ValueError(f"{model_file} has no end-of-sentence piece, which ends documents here")

    @property
    def vocab_size(self):
        return self.processor.get_piece_size()

    @property
    def vocab(self):
        return {self.processor.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self):
        return {i: self.processor.id_to_piece(i) for i in range(self.vocab_size)}

    def tokenize(self, text):
        return self.processor.encode(text, out_type=int)

    def detokenize(self, ids):
        return self.processor.decode(list(ids))


# --tokenizer-type -> the files it reads (argparse dests).
TOKENIZER_TYPES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
}


def tokenizer_files_problem(args):
    """None when the files --tokenizer-type needs are given and exist, else what is wrong, in one line."""
    for dest in TOKENIZER_TYPES[args.tokenizer_type]:
        path = getattr(args, dest, None)
        flag = "--" + dest.replace("_", "-")
        if not path:
            return f"{args.tokenizer_type} needs {flag}"
        if not os.path.isfile(path):
            return f"{flag} {path}: file not found"
    return None


def padded_vocab_size(orig_vocab_size, args):
    """The vocabulary rounded up so each tensor-parallel shard of the embedding is a multiple of
    make_vocab_size_divisible_by rows."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def vocab_size_with_padding(orig_vocab_size, args):
    """padded_vocab_size, said in the log on rank 0 as upstream does."""
    padded = padded_vocab_size(orig_vocab_size, args)
    if getattr(args, "rank", 0) == 0:
        print(f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} dummy tokens "
              f"(new size: {padded})", flush=True)
    return padded


def build_tokenizer(args):
    """Build the tokenizer named by args.tokenizer_type and set args.padded_vocab_size."""
    if getattr(args, "rank", 0) == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    if args.tokenizer_type not in TOKENIZER_TYPES:
        raise NotImplementedError(f"tokenizer type {args.tokenizer_type!r} is not supported here; use one of "
                                  + ", ".join(TOKENIZER_TYPES))
    problem = tokenizer_files_problem(args)
    if problem is not None:
        raise ValueError(problem)
    if args.tokenizer_type == "GPT2BPETokenizer":
        tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
    else:
        tokenizer = GPTSentencePieceTokenizer(args.tokenizer_model)
    args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer
