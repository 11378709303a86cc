"""The one error type the patch set raises for input it cannot honour (a config key, a flag, a missing upstream part).

A library raises; the command line turns it into one line and exit 2 (`patches.launch`, our `megatron`).
"""
import os
import sys

EXIT_BAD_INPUT = 2


class PatchConfigError(ValueError):
    """Input the profiler or a patch cannot honour; its message is the one line a user sees."""


def exit_with_one_line(message: str) -> None:
    """Print `error: message` on global rank 0 only (one copy, not N) and exit 2 on every rank."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)
