"""Shared fixtures, and the `launch` marker's guard (tests/helpers/launch.py): a test that starts
processes must carry the marker, so that `-m "not launch"` is the fast in-process tier. Each launching test
gets a torch extensions directory of its own (tests/helpers/torch_extensions.py)."""
import functools
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import launch, torch_extensions
from tests.helpers.flags import PP2_TP2_CKPT, UPSTREAM_WORKERS

# The environment's own bin directory first on PATH, as tools/run_tests.sh puts it, however pytest was started: the
# ops built for the tests (torch_extensions.py) and every process launched after them then use the environment's
# ninja. A system ninja (Debian's ninja-build) cannot read the other's build log and rebuilds the ops in every launch:
# a minute each on 2 cores.
_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

_extension_copies = []  # the parent of this session's per-test torch extensions directories, removed at its end
_environment = pytest.MonkeyPatch()  # the variable a launching test gets, undone after it


@functools.lru_cache(maxsize=None)
def group_of(path: str) -> str:
    """A test file's group (tools/run_tests.sh runs a group on one worker): the file itself, since its tests share its
    module-scoped launches; the files that import tests/helpers/profiled_runs.py's runs are one group, so that each
    of those runs is launched once."""
    source = (Path(__file__).resolve().parents[1] / path).read_text()
    return "profiled_runs" if _SHARES_RUNS.search(source) else path


_SHARES_RUNS = re.compile(r"^from tests\.helpers\.profiled_runs import .*\bprofiled_run\b", re.MULTILINE)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: without it installed, the tests run in one process
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduling by scope, with group_of's scopes. (Its `--dist loadgroup` reads xdist_group markers
    into node ids in a way pytest 9 no longer sees: each file's tests were split over the workers, and every
    worker launched the module's runs.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0])

    return ByGroup(config, log)


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
