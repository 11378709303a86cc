"""Multi-node through the real `deepspeed` launcher: two launcher invocations with a two-host hostfile.

Each "node" is started on its own (--no_ssh --node_rank N), 2 ranks each, as on a cluster without
passwordless ssh; one report comes out, printed once, by global rank 0, with every stage's ranks.
The ssh/pdsh launch (one launcher starting both nodes) runs where pdsh and an sshd are installed.
"""
import json
import os
import shutil
import signal
import subprocess

import pytest

from patches.profiler.printer import HEADER
from tests.helpers.flags import TINY_GPT, layout
from tests.helpers.launch import REPO, deepspeed_launcher, explain, free_port, remove_shm_buffers
from tests.helpers.multinode import PROFILE_STEP, two_node_profile, write_hostfile
from tests.helpers.tiny_gpt import check_instruction_counts, check_totals, stage_layers

pytestmark = pytest.mark.launch

PRETRAIN = REPO / "pretrain_gpt.py"
SHAPE_KEYS = ("world_size", "pipeline_parallel_size", "tensor_parallel_size", "data_parallel_size",
              "micro_batches", "micro_batch_size")


def assert_printed_once_by_rank_0(nodes, step=PROFILE_STEP):
    """Every rank's output is in its own file (--enable_each_rank_log): only global rank 0's has the report."""
    assert nodes[0].rank_output(0).count(HEADER) == 1
    assert nodes[0].rank_output(0).count(f"Profile Summary at step {step}:") == 1
    for rank in (1, 2, 3):
        assert HEADER not in nodes[rank // 2].rank_output(rank), rank
    assert all(HEADER not in node.output for node in nodes)


def test_pp2_dp2_across_two_nodes(tmp_path_factory):
    run = two_node_profile(tmp_path_factory, "pp2_dp2_zero1")
    nodes, report = run.nodes, run.report
    # The launchers placed ranks 0, 1 on node 0 and ranks 2, 3 on node 1.
    assert [sorted(log.name.rsplit("_", 1)[1] for log in node.rank_logs.glob("*.log")) for node in nodes] == \
        [["rank0.log", "rank1.log"], ["rank2.log", "rank3.log"]]
    assert_printed_once_by_rank_0(nodes)
    assert {key: report["parallelism"][key] for key in SHAPE_KEYS} == {
        "world_size": 4, "pipeline_parallel_size": 2, "tensor_parallel_size": 1, "data_parallel_size": 2,
        "micro_batches": 2, "micro_batch_size": 2}
    # Topology pipe x data x model: stage 0 = ranks 0 (dp 0) and 1 (dp 1), stage 1 = ranks 2 and 3. The
    # report covers one replica, dp rank 0's: stage 0 on node 0, stage 1 on node 1.
    assert [stage["global_ranks"] for stage in report["stages"]] == [[0], [2]]
    check_totals(report, layers=4, sequences=2 * 2, checkpointing=False)
    assert stage_layers(report) == [[1, 2], [3, 4]]
    check_instruction_counts(report, micro_batches=2)
    # Each stage reduced its gradients over its data-parallel pair, (0, 1) and (2, 3).
    assert all(stage["instructions"]["ReduceGrads"]["count"] == 1 for stage in report["stages"])


def test_pp4_across_two_nodes(tmp_path_factory):
    run = two_node_profile(tmp_path_factory, "pp4_embedding_stage")
    nodes, report = run.nodes, run.report
    assert_printed_once_by_rank_0(nodes)
    assert {key: report["parallelism"][key] for key in SHAPE_KEYS} == {
        "world_size": 4, "pipeline_parallel_size": 4, "tensor_parallel_size": 1, "data_parallel_size": 1,
        "micro_batches": 16, "micro_batch_size": 2}
    # Stages 0, 1 on node 0 (localhost), stages 2, 3 on node 1 (127.0.0.1); activations cross between 1 and 2.
    assert [stage["global_ranks"] for stage in report["stages"]] == [[0], [1], [2], [3]]
    check_totals(report, layers=2, sequences=2 * 16, checkpointing=True)
    check_instruction_counts(report, micro_batches=16)


# ---------------------------------------------------------------------------- ssh / pdsh
def _pdsh_unavailable():
    missing = [tool for tool in ("pdsh", "ssh", "ssh-keygen") if shutil.which(tool) is None]
    if not os.path.exists("/usr/sbin/sshd"):
        missing.append("/usr/sbin/sshd")
    return missing


@pytest.fixture
def local_sshd(tmp_path):
    """An sshd of our own on a free port of 127.0.0.1, accepting one key; `ssh` on PATH uses it."""
    ssh_dir = tmp_path / "ssh"
    ssh_dir.mkdir()
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", ssh_dir / key], check=True, timeout=30)
    shutil.copy(ssh_dir / "client_key.pub", ssh_dir / "authorized_keys")
    port = free_port()
    config = ssh_dir / "sshd_config"
    config.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {ssh_dir / 'host_key'}\n"
                      f"AuthorizedKeysFile {ssh_dir / 'authorized_keys'}\nPasswordAuthentication no\n"
                      f"PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nPidFile {ssh_dir / 'sshd.pid'}\n")
    check = subprocess.run(["/usr/sbin/sshd", "-t", "-f", config], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        pytest.skip(f"sshd cannot run here: {check.stderr.strip()}")
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", config], stderr=subprocess.DEVNULL)
    # The launcher runs plain `ssh HOST ...` (its reachability check, `hostname -I`, pdsh): a wrapper
    # first on PATH points every such call at this sshd, as ~/.ssh/config would on a cluster.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -p {port} -i {ssh_dir / 'client_key'} "
                       f"-o StrictHostKeyChecking=no -o UserKnownHostsFile={ssh_dir / 'known_hosts'} "
                       f"-o BatchMode=yes \"$@\"\n")
    wrapper.chmod(0o755)
    try:
        yield bin_dir
    finally:
        sshd.send_signal(signal.SIGTERM)
        sshd.wait(timeout=30)


@pytest.mark.skipif(bool(_pdsh_unavailable()), reason=f"the ssh/pdsh launch needs {', '.join(_pdsh_unavailable())}")
def test_pp4_through_ssh_and_pdsh(local_sshd, tmp_path):
    """One `deepspeed --hostfile` invocation: the launcher checks ssh, asks node 0 its address
    (`ssh localhost hostname -I`) and starts both nodes through pdsh."""
    hostfile = write_hostfile(tmp_path, slots=2)
    # pdsh passes on only PYTHON* variables (and the launcher's own); the rest go in .deepspeed_env.
    (tmp_path / ".deepspeed_env").write_text("OMP_NUM_THREADS=1\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               PATH=f"{local_sshd}{os.pathsep}{os.environ['PATH']}")
    port = free_port()
    command = [deepspeed_launcher(), "--hostfile", str(hostfile), "--master_port", str(port), str(PRETRAIN)]
    command += [str(a) for a in TINY_GPT + layout(pp=4) + ["--global-batch-size", "8",
                                            "--train-iters", "1", "--profile-flops-step", "1",
                                            "--profile-flops-output", tmp_path / "profile"]]
    try:
        process = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        remove_shm_buffers(port)
    assert process.returncode == 0, explain(process)
    output = process.stdout + process.stderr
    assert output.count(HEADER) == 1
    # pdsh prefixes each line with the host it came from: the report came from node 0.
    assert all(line.startswith("localhost: ") for line in output.splitlines() if HEADER in line)
    report = json.loads((tmp_path / "profile" / "flops_profile_step1.json").read_text())
    assert [stage["global_ranks"] for stage in report["stages"]] == [[0], [1], [2], [3]]
    check_totals(report, layers=4, sequences=2 * 4, checkpointing=False)
