"""Shared fixtures, and the `launch` marker's guard (tests/helpers/launch.py): a test that starts
processes must carry the marker, so that `-m "not launch"` is the fast in-process tier."""
import pytest

from tests.helpers import launch
from tests.helpers.flags import PP2_TP2_CKPT


def pytest_runtest_setup(item):
    # Runs before any fixture of the test, so session fixtures that launch are covered too.
    launch.allow_launches(item.get_closest_marker("launch") is not None)


@pytest.fixture(scope="session")
def pp2_tp2_plain_run(tmp_path_factory):
    """(process, {iteration: loss}) of 20 unprofiled pp2 x tp2 iterations with activation checkpointing:
    shared by the fork's training test and the profiler's bitwise-identical-losses test."""
    tmp = tmp_path_factory.mktemp("pp2_tp2_plain")
    process, losses = launch.run_pretrain(tmp, 4, PP2_TP2_CKPT, name="plain")
    assert process.returncode == 0, launch.explain(process)
    return process, losses
