from .tokenizer import GPT2BPETokenizer, GPTSentencePieceTokenizer, build_tokenizer, vocab_size_with_padding

__all__ = ["GPT2BPETokenizer", "GPTSentencePieceTokenizer", "build_tokenizer", "vocab_size_with_padding"]
