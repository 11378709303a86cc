"""The few process-wide objects Megatron code reaches for: the parsed args and the tokenizer."""
_ARGS = None
_TOKENIZER = None


def set_args(args):
    global _ARGS
    _ARGS = args


def get_args():
    if _ARGS is None:
        raise RuntimeError("megatron args are not set: call initialize_megatron() first")
    return _ARGS


def set_tokenizer(tokenizer):
    global _TOKENIZER
    _TOKENIZER = tokenizer


def get_tokenizer():
    return _TOKENIZER
