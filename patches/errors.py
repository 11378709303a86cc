"""The one error type the patch set raises for input it cannot honour (a config key, a flag, a missing upstream part).

A library raises; the command line turns it into one line and exit 2 (`patches.launch`, our `megatron`).
"""
import os
import sys
import time

EXIT_BAD_INPUT = 2
# How long another rank waits, at most, for global rank 0 to say an error they both met. A launcher ends every
# rank once one has exited non-zero: a rank that exited first could end rank 0 before it printed the line (seen
# under load: exit code 2 and no line). Rank 0's exit ends the wait.
RANK_0_GRACE_S = 15.0


class PatchConfigError(ValueError):
    """Input the profiler or a patch cannot honour; its message is the one line a user sees."""


def exit_with_one_line(message: str) -> None:
    """Print `error: message` on global rank 0 only (one copy, not N) and exit 2 on every rank; the other ranks give
    rank 0 up to RANK_0_GRACE_S to say it first."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(RANK_0_GRACE_S)
    sys.exit(EXIT_BAD_INPUT)
