"""DeepSpeed stays DeepSpeed: public-API scenarios trained twice, by stock DeepSpeed (the flops_profiler
section off) and with patches.apply() and the section on. Losses must match bit for bit and the profile
must be there. All scenarios share two launches (tests/scripts/compat_scenarios.py)."""
import json

import pytest

from tests.helpers.launch import REPO, explain, launch

pytestmark = pytest.mark.launch

SCRIPT = REPO / "tests" / "scripts" / "compat_scenarios.py"
HEADER = "DeepSpeed Flops Profiler"
SCENARIOS = ["pipe_no_steps_per_print", "plain_no_steps_per_print"]
NPROCS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for mode in ("stock", "patched"):
        out = tmp_path_factory.mktemp(mode)
        process = launch(SCRIPT, NPROCS, [out, mode] + SCENARIOS, cwd=out)
        assert process.returncode == 0, explain(process)
        results[mode] = out
    return results


def _result(runs, mode, name, rank=0):
    return json.loads((runs[mode] / f"{name}.rank{rank}.json").read_text())


@pytest.mark.parametrize("name", SCENARIOS)
def test_losses_bitwise_identical_and_profile_printed(runs, name):
    for rank in range(NPROCS):
        assert _result(runs, "patched", name, rank)["losses"] == _result(runs, "stock", name, rank)["losses"]
    text = (runs["patched"] / f"{name}.profile.txt").read_text()
    assert text.count(HEADER) == 1 and "Profile Summary at step 2:" in text
