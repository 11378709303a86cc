"""Run pretrain_gpt.py (or any script) in several processes on CPU over gloo: under the real `deepspeed` launcher,
what users run and what every test of a launch's own behaviour uses (its exit codes, the lines a failing rank
leaves), or under torch's own `torchrun` (via=TORCHRUN), for runs that only train and report: the ranks run the
same code either way, and torchrun starts them without the two DeepSpeed imports the deepspeed launcher makes
first (its runner, then its per-node launch.py): a no-op script takes 2.1 s of CPU under torchrun, 5.2 s under
the deepspeed launcher.

Every multi-process test carries the `launch` marker, so `-m "not launch"` keeps the in-process tier
fast. free_port() and deepspeed_launcher(), which every launch needs, check it: a test that starts
processes without the marker fails at once instead of slowing the fast tier down.
"""
import importlib
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers.flags import TINY_GPT

REPO = Path(__file__).resolve().parents[2]

_launches_allowed = True


def allow_launches(allowed):
    """Set by conftest before each test: whether the test carries the `launch` marker."""
    global _launches_allowed
    _launches_allowed = allowed


def _require_launch_marker():
    if not _launches_allowed:
        raise RuntimeError("this test starts processes: mark it @pytest.mark.launch")


def free_port():
    """A port for a launch's rendezvous, free now and below the kernel's ephemeral range: a port the kernel handed
    out (bind to 0) is also what it gives the next outgoing connection, and a concurrent launch's connection took
    one before torchrun listened on it (EADDRINUSE)."""
    _require_launch_marker()
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:  # not Linux: IANA's ephemeral range starts at 49152
        ephemeral_low = 49152
    # The system's randomness, not the random module's global state, which code under test seeds (Megatron's and
    # DeepSpeed's seed helpers call random.seed): in a fresh-clone run both xdist workers drew port 27835 at once,
    # and two 4-rank launches met at one rendezvous and hung.
    for port in random.SystemRandom().sample(range(_LOWEST_PORT, ephemeral_low), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found between {_LOWEST_PORT} and {ephemeral_low}")


_LOWEST_PORT = 20000  # above the registered services tests might meet


def deepspeed_launcher():
    _require_launch_marker()
    return str(Path(sys.executable).parent / "deepspeed")


DEEPSPEED, TORCHRUN = "deepspeed", "torchrun"  # launch(via=...)


def bare_env(**variables):
    """The whole environment of a process that must not inherit this one's: a plain PATH after this interpreter's
    own bin directory, PYTHONPATH at this checkout, the test's torch extensions directory (conftest.py), and
    `variables`. The bin directory holds the environment's ninja, which built the test's copy of DeepSpeed's ops:
    another ninja (a system one) cannot read its build log and rebuilds them (a minute or two on 2 cores)."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    return dict(env, **variables)


def launch(script, nprocs, script_args, cwd, timeout=300, env=None, launcher=None, launcher_args=(), via=DEEPSPEED):
    """`deepspeed --num_gpus N [launcher_args] script args` (via=TORCHRUN: `torchrun --nproc_per_node N ...`);
    returns the CompletedProcess (text output). launcher: another environment's `deepspeed` command (default: this
    one's)."""
    port = free_port()
    if via == TORCHRUN:
        start = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(nprocs)]
    else:
        start = [*(launcher or [deepspeed_launcher()]), "--num_gpus", str(nprocs)]
    command = [*start, "--master_port", str(port), *launcher_args, str(script)] + [str(a) for a in script_args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    full_env.update(env or {})
    try:
        return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    finally:
        remove_shm_buffers(port)


def remove_shm_buffers(port):
    """DeepSpeed 0.19.8's CPU comm op leaves a 66 MiB /dev/shm buffer per rank behind; a test suite
    of dozens of launches would fill memory. The run on `port` is over: remove its buffers."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def run_pretrain(tmp_path, nprocs, extra_args, name="run", timeout=300, env=None, via=DEEPSPEED):
    """Run pretrain_gpt.py with the tiny GPT; returns (process, {iteration: loss}). env: variables to add."""
    loss_file = Path(tmp_path) / f"{name}_losses.jsonl"
    args = TINY_GPT + ["--loss-record-file", loss_file] + list(extra_args)
    process = launch(REPO / "pretrain_gpt.py", nprocs, args, cwd=tmp_path, timeout=timeout, env=env, via=via)
    return process, read_losses(loss_file)


def read_losses(path):
    if not Path(path).exists():
        return {}
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["iteration"]: float.fromhex(r["loss_hex"]) for r in records}


def explain(process):
    """Enough of a failed run's output to debug it from a CI log."""
    return (f"rc={process.returncode}\n--- stdout (tail) ---\n{process.stdout[-4000:]}\n"
            f"--- stderr (tail) ---\n{process.stderr[-4000:]}")


def load_tool(name):
    """A command-line tool (patches/cli/, also tools/NAME.py) as a module, to test its functions directly."""
    return importlib.import_module(f"patches.cli.{name}")
