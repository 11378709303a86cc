"""Two "nodes" on this one machine, each started by its own `deepspeed` launcher, as across real nodes:

    deepspeed --hostfile hostfile --no_ssh --node_rank N --master_addr ADDR --master_port PORT script ...

The hostfile names this machine twice, as `localhost` and `127.0.0.1`: the launcher only needs
distinct names, and with --no_ssh it never contacts them (node N is the hostfile's N-th line).
"""
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.flags import PP2, TINY_GPT, layout
from tests.helpers.launch import REPO, deepspeed_launcher, free_port, remove_shm_buffers

HOSTS = ("localhost", "127.0.0.1")
PROFILE_STEP = 1


def _deepspeed_config(tmp, config):
    (tmp / "ds_config.json").write_text(json.dumps(config))
    return ["--deepspeed", "--deepspeed_config", tmp / "ds_config.json"]


# Profiled two-node runs, each launched once per session by whichever test asks first: test_multinode
# checks what is multi-node about them, test_scale their shapes (a launch costs ~20 s on 2 cores).
RUNS = {  # name: flags after TINY_GPT, given the run's directory
    # pipeline 2 x data 2 with ZeRO stage 1, saving a checkpoint at the end
    "pp2_dp2_zero1": lambda tmp: PP2 + ["--save", tmp / "checkpoints"]
    + _deepspeed_config(tmp, {"zero_optimization": {"stage": 1}}),
    # pipeline 4 over 2 layers, embedding and LM head weighed: stage 0 holds only the embedding,
    # stage 3 only the LM head; 16 micro-batches, activation checkpointing
    "pp4_embedding_stage": lambda tmp: ["--num-layers", "2"] + layout(pp=4)
    + ["--pp-partition-method", "type:transformer|embedding", "--global-batch-size", "32", "--checkpoint-activations"],
}
_runs = {}


@dataclass
class Node:
    process: subprocess.Popen
    log: Path
    rank_logs: Path  # the launcher's --enable_each_rank_log directory: one file per rank of this node
    port: int
    ended_at: float = None

    @property
    def output(self):
        return self.log.read_text()

    def rank_output(self, rank):
        """What global rank `rank` printed, if it ran on this node."""
        files = list(self.rank_logs.glob(f"*_rank{rank}.log"))
        return files[0].read_text() if files else None


def write_hostfile(directory, slots):
    path = Path(directory) / "hostfile"
    path.write_text("".join(f"{host} slots={slots}\n" for host in HOSTS))
    return path


def start_nodes(script, script_args, cwd, ranks_per_node=2, env=None):
    """Start both launchers, node 1 first (nodes may come up in any order); returns them without waiting."""
    cwd = Path(cwd)
    hostfile = write_hostfile(cwd, ranks_per_node)
    port = free_port()
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    full_env.update(env or {})
    nodes = []
    for node_rank in reversed(range(len(HOSTS))):
        rank_logs = cwd / f"node{node_rank}_ranks"
        command = [deepspeed_launcher(), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node_rank),
                   "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "--enable_each_rank_log", str(rank_logs), str(script)] + [str(a) for a in script_args]
        log = cwd / f"node{node_rank}.log"
        with open(log, "w") as out:
            # Its own session, so that a timeout can end this launcher and its ranks, and nothing else.
            process = subprocess.Popen(command, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        nodes.insert(0, Node(process, log, rank_logs, port))
    return nodes


def wait_nodes(nodes, timeout):
    """Wait for every launcher; on timeout kill them all and fail. Records when each one ended."""
    deadline = time.time() + timeout
    pending = list(nodes)
    try:
        while pending:
            for node in list(pending):
                if node.process.poll() is not None:
                    node.ended_at = time.time()
                    pending.remove(node)
            if pending and time.time() > deadline:
                for node in pending:
                    os.killpg(node.process.pid, signal.SIGKILL)
                    node.process.wait()
                raise AssertionError(f"launchers still running after {timeout} s:\n" +
                                     "\n".join(n.output[-3000:] for n in pending))
            time.sleep(0.1)
    finally:
        remove_shm_buffers(nodes[0].port)
    return nodes


def run_nodes(script, script_args, cwd, ranks_per_node=2, env=None, timeout=300):
    return wait_nodes(start_nodes(script, script_args, cwd, ranks_per_node, env), timeout)


def explain_nodes(nodes):
    parts = []
    for index, node in enumerate(nodes):
        parts.append(f"--- node {index}: rc={node.process.returncode} ---\n{node.output[-3000:]}")
        for log in sorted(node.rank_logs.glob("*.log")):
            parts.append(f"--- {log.name} (tail) ---\n{log.read_text()[-2000:]}")
    return "\n".join(parts)


@dataclass
class ProfiledRun:
    nodes: list
    report: dict
    directory: Path


def two_node_profile(tmp_path_factory, name):
    """RUNS[name] on two nodes, iteration PROFILE_STEP profiled; launched on first use."""
    if name not in _runs:
        tmp = tmp_path_factory.mktemp(name)
        flags = TINY_GPT + RUNS[name](tmp) + ["--train-iters", str(PROFILE_STEP), "--profile-flops-step",
                                              str(PROFILE_STEP), "--profile-flops-output", tmp / "profile"]
        nodes = run_nodes(REPO / "pretrain_gpt.py", flags, cwd=tmp, timeout=300)
        assert [node.process.returncode for node in nodes] == [0, 0], explain_nodes(nodes)
        report = json.loads((tmp / "profile" / f"flops_profile_step{PROFILE_STEP}.json").read_text())
        _runs[name] = ProfiledRun(nodes, report, tmp)
    return _runs[name]
