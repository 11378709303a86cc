"""Shared fixtures, and the `launch` marker's guard (tests/helpers/launch.py): a test that starts
processes must carry the marker, so that `-m "not launch"` is the fast in-process tier. Each launching test
gets a torch extensions directory of its own (tests/helpers/torch_extensions.py)."""
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers import launch, profiled_runs, torch_extensions
from tests.helpers.flags import PP2_TP2_CKPT, UPSTREAM_WORKERS

_extension_copies = []  # the parent of this session's per-test torch extensions directories, removed at its end
_environment = pytest.MonkeyPatch()  # the variable a launching test gets, undone after it


def pytest_collection_modifyitems(items):
    """Groups for pytest-xdist's `--dist loadgroup` (tools/run_tests.sh): a group runs on one worker. A file is
    one group, since its tests share its module-scoped launches; the files that read the runs of
    tests/helpers/profiled_runs.py are one group, so that each of those runs is launched once."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            shares_runs = profiled_runs.profiled_run in vars(item.module).values()
            item.add_marker(pytest.mark.xdist_group("profiled_runs" if shares_runs else item.path.name))


def pytest_runtest_setup(item):
    # Runs before any fixture of the test, so session fixtures that launch are covered too.
    launches = item.get_closest_marker("launch") is not None
    launch.allow_launches(launches)
    if launches:
        if not _extension_copies:
            _extension_copies.append(tempfile.mkdtemp(prefix="patches-tests-torch-ext-"))
        copy = torch_extensions.fresh_copy(Path(tempfile.mkdtemp(dir=_extension_copies[0])))
        _environment.setenv("TORCH_EXTENSIONS_DIR", str(copy))


def pytest_runtest_teardown(item):
    _environment.undo()


def pytest_sessionfinish(session):
    for directory in _extension_copies:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def pp2_tp2_run_dir(tmp_path_factory):
    """The directory of pp2_tp2_plain_run; its checkpoints (iterations 10 and 20) are in `ckpt/`."""
    return tmp_path_factory.mktemp("pp2_tp2_plain")


@pytest.fixture(scope="session")
def pp2_tp2_plain_run(pp2_tp2_run_dir):
    """(process, {iteration: loss}) of 20 unprofiled pp2 x tp2 iterations with activation checkpointing:
    shared by the fork's training test and the profiler's bitwise-identical-losses test. It reads its data
    with upstream's default 2 DataLoader workers; the runs compared with it read in-line (flags.TINY_GPT)."""
    # Saving reads the generators and changes nothing; the upstream-format resume test loads iteration 10.
    saving = ["--save", pp2_tp2_run_dir / "ckpt", "--save-interval", "10"]
    process, losses = launch.run_pretrain(pp2_tp2_run_dir, 4, PP2_TP2_CKPT + saving + UPSTREAM_WORKERS,
                                          name="plain", via=launch.TORCHRUN)
    assert process.returncode == 0, launch.explain(process)
    return process, losses
