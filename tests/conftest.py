import sys
from pathlib import Path

# Tests import their helpers (launch.py) and the project from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402

from launch import explain, run_pretrain  # noqa: E402

# pp2 x tp2 with activation checkpointing: shared by the fork's training test and the profiler's
# bitwise-identical-losses test, so the 4-process run is paid once per session.
# The schedule every fork test shares: with --lr-decay-iters fixed, a 5- or 10-iteration run sees the
# same learning rates as the first iterations of a 20-iteration one, so runs can serve several tests.
SCHEDULE = ["--global-batch-size", "8", "--lr", "3e-3", "--lr-decay-iters", "20"]
PP2_TP2_CKPT = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                "--train-iters", "20", "--checkpoint-activations"] + SCHEDULE


@pytest.fixture(scope="session")
def pp2_tp2_plain_run(tmp_path_factory):
    """(process, {iteration: loss}) of 20 unprofiled iterations."""
    tmp = tmp_path_factory.mktemp("pp2_tp2_plain")
    process, losses = run_pretrain(tmp, 4, PP2_TP2_CKPT, name="plain")
    assert process.returncode == 0, explain(process)
    return process, losses
