"""A run that finished exits 0: the fork's part of patches.process.clean_exit (which says why).

The patch set's teardown ends every process group before the interpreter finalizes and forgets the groups
held by the profiler and by DeepSpeed; the fork adds its own layout (megatron.mpu), which the patch set
cannot know of (it never imports `megatron`).
"""
import sys

from patches.process import clean_exit


def release_layout() -> None:
    """Forget megatron.mpu's layout and the groups it holds (none where it was never imported)."""
    parallel_state = sys.modules.get("megatron.mpu.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()


def teardown_process_groups() -> None:
    """Destroy every process group of this process and release every reference to them we know of."""
    clean_exit.teardown_process_groups(release_layout)


def at_exit() -> None:
    """Register the teardown to run at a normal interpreter exit (a rank leaving by os._exit skips it)."""
    clean_exit.at_exit(release_layout)
