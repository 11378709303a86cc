from .tokenizer import GPT2BPETokenizer, build_tokenizer, vocab_size_with_padding

__all__ = ["GPT2BPETokenizer", "build_tokenizer", "vocab_size_with_padding"]
