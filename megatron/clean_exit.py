"""A run that finished exits 0: the process groups are torn down while the interpreter is whole.

torch (2.13) lets a gloo worker thread drop a finished collective's tensors after the caller has
returned from it; dropping a tensor with a Python object takes the GIL. A worker that asks for the
GIL once the interpreter has started finalizing is ended by it, inside a C++ destructor, and the
process aborts ("terminate called without an active exception", exit -6) although the run succeeded.
destroy_process_group() alone does not end the workers (gloo has no shutdown; they end with the
group's last reference, which DeepSpeed's engine and grid keep), so after it the main thread lets go
of the GIL for a moment: a worker waiting for it takes it, drops its tensors and goes idle.
"""
import atexit
import time

import torch

# Long enough for a worker that is due the GIL to be scheduled on a busy machine; nothing at exit.
GIL_GRACE_S = 0.1


def teardown_process_groups() -> None:
    """Destroy every process group of this process, then give gloo's workers the GIL to finish with."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        time.sleep(GIL_GRACE_S)  # the sleep releases the GIL


def at_exit() -> None:
    """Register the teardown to run at a normal interpreter exit (a rank leaving by os._exit skips it)."""
    atexit.register(teardown_process_groups)
