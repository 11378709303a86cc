"""The suite's own guard against a hang (tests/helpers/torch_extensions.py): a lock a killed process left in one
test's torch extensions directory is not in the next test's, and the next test loads the built ops as they are,
without building."""
import os
import subprocess
import sys

import pytest

from tests.helpers.torch_extensions import fresh_copy, prebuilt

pytestmark = pytest.mark.launch  # the first call builds DeepSpeed's CPU ops: a minute on two cores

LOAD_SHM_OP = """
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load()
"""


def test_a_lock_left_in_one_copy_is_not_in_the_next_and_nothing_is_rebuilt(tmp_path):
    first = fresh_copy(tmp_path / "first")
    op_dirs = sorted(path.name for path in prebuilt().iterdir())
    assert op_dirs == sorted(path.name for path in first.iterdir())
    assert "deepspeed_shm_comm" in op_dirs
    (first / "deepspeed_shm_comm" / "lock").touch()  # what a process killed while loading leaves

    second = fresh_copy(tmp_path / "second")
    assert not (second / "deepspeed_shm_comm" / "lock").exists()
    library = second / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built = os.stat(prebuilt() / "deepspeed_shm_comm" / "deepspeed_shm_comm.so")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(second))
    process = subprocess.run([sys.executable, "-c", LOAD_SHM_OP], env=env, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]
    assert os.stat(library).st_ino == built.st_ino  # loaded as built: ninja relinked nothing
    assert not (second / "deepspeed_shm_comm" / "lock").exists()
