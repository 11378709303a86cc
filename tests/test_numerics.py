"""Numerics untouched: profiling an iteration changes no bit of any loss, in bf16 as in fp32.

pipeline 2 x tensor 2, activation checkpointing, and dropout on (so the profiler must also leave every
random stream alone: the default generator, the tensor-parallel tracker, and the RNG states that
checkpointing saves and restores for the recompute). bf16 runs DeepSpeed's bf16 optimizer, which
clips by itself (our optimizer is plain AdamW under it). fp32 with dropout off is checked by
test_profiler_pipeline.py::test_profiling_leaves_losses_bitwise_identical.
"""
import json

import pytest

from tests.helpers.flags import TINY_GPT, layout
from tests.helpers.launch import TORCHRUN, explain, run_pretrain

pytestmark = pytest.mark.launch

ITERS = 3
PROFILE_STEP = 2
FLAGS = TINY_GPT + layout(pp=2, tp=2) + ["--global-batch-size", "8", "--train-iters", str(ITERS),
                                         "--checkpoint-activations", "--hidden-dropout", "0.1",
                                         "--attention-dropout", "0.1"]


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """{'plain': (process, losses), 'profiled': (process, losses)}, both bf16."""
    runs = {}
    for name, extra in (("plain", []), ("profiled", ["--profile-flops-step", str(PROFILE_STEP)])):
        tmp = tmp_path_factory.mktemp(f"bf16_{name}")
        process, losses = run_pretrain(tmp, 4, FLAGS + ["--bf16", "--profile-flops-output", tmp] + extra, name=name,
                                               via=TORCHRUN)
        assert process.returncode == 0, explain(process)
        runs[name] = (tmp, process, losses)
    return runs


def test_bf16_losses_bitwise_identical_with_and_without_profiling(bf16_runs):
    _, _, plain = bf16_runs["plain"]
    _, _, profiled = bf16_runs["profiled"]
    assert sorted(plain) == list(range(1, ITERS + 1))
    assert profiled == plain  # float equality at every iteration, the profiled one and those after it


def test_bf16_trains_and_is_reported_as_bf16(bf16_runs):
    tmp, process, losses = bf16_runs["profiled"]
    report = json.loads((tmp / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    assert report["device"]["dtype"] == "bf16"
    # DeepSpeed's bf16 optimizer clipped and reported the gradient norm, a finite number on every iteration.
    norms = [float(line.split("grad norm: ")[1].split(" ")[0]) for line in process.stdout.splitlines()
             if "grad norm: " in line]
    assert len(norms) == ITERS and all(0 < norm < 100 for norm in norms)
    assert all(loss == loss and 0 < loss < 10 for loss in losses.values())
