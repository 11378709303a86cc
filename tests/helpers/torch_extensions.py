"""A torch extensions directory of its own for every launching test, so that no killed process can hang the rest.

DeepSpeed JIT-builds its CPU ops into torch's extensions directory: the shared-memory comm op that every
`init_distributed` loads, and fused Adam. Every process that loads one holds a lock file there for a moment,
built or not (torch's cpp_extension takes it to ask ninja whether anything changed). A process killed in that
moment leaves the lock behind, and every later process of every later test waits on it forever, silently. The
suite kills processes on purpose (the launcher ends a failed rank's siblings, the fault tests kill ranks), so
this happens: a CI run once hung in every launch after the first few tests.

So the ops are built once per environment, by a process nobody kills, into a directory made complete before it
is renamed into place; each launching test gets a copy (large files hard-linked), and a lock left behind stays
in that test's copy.
"""
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The ops this suite's processes load on the CPU accelerator.
OP_BUILDERS = ("ShareMemCommBuilder", "FusedAdamBuilder")
# What ninja may rewrite in a no-op build: copied, never shared between tests.
NINJA_STATE = {"build.ninja", ".ninja_log", ".ninja_deps"}
BUILD_TIMEOUT_S = 1200

_BUILD = f"""
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
for name in {OP_BUILDERS!r}:
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load()
"""
# The environment and when its torch and DeepSpeed were installed: ninja compares the sources' times with the
# build's, so a build made before a reinstall at the same prefix would be rebuilt in every copy.
_IDENTITY = ("import os, sys, torch, deepspeed; print(sys.prefix, torch.__version__, deepspeed.__version__, "
             "os.stat(torch.__file__).st_mtime_ns, os.stat(deepspeed.__file__).st_mtime_ns)")
_prebuilt_paths = {}  # interpreter -> its build's directory, found once a session


def _prebuilt_path(python: str) -> Path:
    """One directory per installed environment: the build's command lines name its torch and DeepSpeed."""
    if python not in _prebuilt_paths:
        printed = subprocess.run([python, "-c", _IDENTITY], capture_output=True, text=True, check=True).stdout
        identity = printed.strip().splitlines()[-1]  # after whatever DeepSpeed logs on import
        key = hashlib.sha1(identity.encode()).hexdigest()[:12]
        _prebuilt_paths[python] = Path(tempfile.gettempdir()) / f"patches-tests-torch-extensions-{key}"
    return _prebuilt_paths[python]


def prebuilt(python: str = sys.executable) -> Path:
    """The built ops of python's environment, building them first if no complete build is there."""
    final = _prebuilt_path(python)
    if final.is_dir():
        return final
    # The suite's workers (pytest-xdist) may all ask at once: one builds, the others wait for it.
    with open(final.parent / (final.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return final if final.is_dir() else _build(python, final)


def _build(python: str, final: Path) -> Path:
    building = Path(tempfile.mkdtemp(prefix=final.name + ".building-", dir=final.parent))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(building))
    process = subprocess.run([python, "-c", _BUILD], env=env, capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S)
    if process.returncode != 0:
        shutil.rmtree(building, ignore_errors=True)
        raise RuntimeError(f"building DeepSpeed's CPU ops for the tests failed ({python}):\n{process.stderr[-3000:]}")
    try:
        building.rename(final)
    except OSError:  # another session renamed its complete build into place first
        shutil.rmtree(building, ignore_errors=True)
    return final


def fresh_copy(destination: Path, python: str = sys.executable) -> Path:
    """destination filled with python's built ops, ready to load without building: returns destination."""
    source = prebuilt(python)
    for op_dir in source.iterdir():
        target = destination / op_dir.name
        target.mkdir(parents=True)
        for path in op_dir.iterdir():
            if path.name == "lock":
                continue
            if path.name in NINJA_STATE:
                shutil.copy2(path, target / path.name)
            else:
                os.link(path, target / path.name)
    return destination
