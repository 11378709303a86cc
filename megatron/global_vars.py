"""The process-wide parsed args, which Megatron code reaches for with get_args()."""
_ARGS = None


def set_args(args):
    global _ARGS
    _ARGS = args


def get_args():
    if _ARGS is None:
        raise RuntimeError("megatron args are not set: call initialize_megatron() first")
    return _ARGS
