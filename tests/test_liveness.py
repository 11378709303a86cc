"""megatron/liveness.py on its own: what a rank says when it fails after the rendezvous store is gone, and
when the job is ended from outside.

Two plain processes, no training: one hosts the TCPStore (as global rank 0 does), the other starts
the heartbeat as rank 3 of 4. The host is killed, then rank 3 fails. Rank 0 may well exit before a
failing rank has written its verdict; the failing rank must still name itself, not blame rank 0, unless
its error only says that a peer is gone. Then two ranks of two, rank 0 hosting the store: rank 0 is sent
SIGTERM, as DeepSpeed's launcher sends it to its ranks one after the other when the job is stopped.
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.launch import REPO, free_port

STORE_HOST = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    print("ready", flush=True)
    time.sleep(60)
""")

FAILING_RANK = textwrap.dedent("""
    import os, sys
    from megatron import liveness
    liveness.start(rank=3, world_size=4)
    print("started", flush=True)
    sys.stdin.readline()  # the test kills the store's host, then says go
    error = RuntimeError("injected fault on rank 3")
    {attach}
    liveness.exit_after_failure(error, iteration=2)
""")


def _fail_after_the_store_is_gone(attach):
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO))
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "ready"
        rank = subprocess.Popen([sys.executable, "-c", FAILING_RANK.format(attach=attach)], env=env, cwd=REPO,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert rank.stdout.readline().strip() == "started"
        host.send_signal(signal.SIGKILL)
        host.wait(timeout=10)
        _, stderr = rank.communicate("go\n", timeout=60)
        return rank.returncode, [line for line in stderr.splitlines() if line.startswith("error: rank")]
    finally:
        host.kill()


@pytest.mark.launch
def test_a_rank_the_report_named_says_it_failed_when_the_store_is_gone():
    """The report's gather told every rank who failed (failed_ranks); the failing rank needs no store to know."""
    code, lines = _fail_after_the_store_is_gone(
        'error.failed_ranks, error.reason = [3], "building its profile entry: RuntimeError: injected fault"')
    assert code == 1
    assert lines == ["error: rank 3 failed in iteration 2: RuntimeError: injected fault on rank 3"]


@pytest.mark.launch
def test_a_rank_failing_with_its_own_error_names_itself_when_the_store_is_gone():
    """Rank 0, and the store with it, may exit before a failing rank records its error: an error of the
    rank's own (not a broken connection) is still its own failure, whoever else has ended."""
    code, lines = _fail_after_the_store_is_gone("")
    assert code == 1
    assert lines == ["error: rank 3 failed in iteration 2: RuntimeError: injected fault on rank 3"]


@pytest.mark.launch
def test_a_rank_that_lost_its_peer_with_the_store_gone_says_the_store_host_ended():
    """A broken connection says only that a peer is gone: without the store, rank 0 (its host) ended."""
    code, lines = _fail_after_the_store_is_gone(
        'error = RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4242")')
    assert code == 1
    assert len(lines) == 1 and lines[0].startswith("error: rank 3 stops in iteration 2: rank 0 failed first "
                                                   "(the rendezvous store it hosts at 127.0.0.1:"), lines
    assert lines[0].endswith("here: RuntimeError: Connection closed by peer [127.0.0.1]:4242"), lines


RANK_OF_TWO = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from megatron import liveness
    rank = int(sys.argv[1])
    if rank == 0:  # global rank 0 hosts the rendezvous store
        store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
    monitor = liveness.start(rank=rank, world_size=2)
    while monitor.store.add(f"megatron/liveness/heartbeat/{rank}", 0) == 0:  # its heartbeat has begun
        time.sleep(0.05)
    print("started", flush=True)
    if sys.argv[3:] == ["exits"]:
        sys.exit(2)  # as a rank refusing bad input: through the interpreter's exit, no error record
    time.sleep(60)  # as a rank computing: only its heartbeat thread can end it
""")


def _ranks_of_two(rank_1_exits=False):
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO))
    return [subprocess.Popen([sys.executable, "-c", RANK_OF_TWO, str(rank), str(port)]
                             + (["exits"] if rank == 1 and rank_1_exits else []), env=env, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]


@pytest.mark.launch
def test_a_job_ended_from_outside_stops_every_rank_at_once_and_blames_none():
    """SIGTERM to rank 0 with no rank failed: rank 0 says it was stopped, and rank 1, never signalled, stops
    within a few heartbeats saying the same, instead of blaming rank 0 once its store is gone (or running on)."""
    ranks = _ranks_of_two()
    try:
        for rank in ranks:
            assert rank.stdout.readline().strip() == "started"
        ranks[0].send_signal(signal.SIGTERM)
        said = [rank.communicate(timeout=15)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    lines = [[line for line in stderr.splitlines() if line.startswith("error: rank")] for stderr in said]
    assert lines == [["error: rank 0 stopped by SIGTERM: the job was ended from outside, no rank failed"],
                     ["error: rank 1 stops: rank 0 stopped by SIGTERM: the job was ended from outside, no rank "
                      "failed"]], said
    assert [rank.returncode for rank in ranks] == [128 + signal.SIGTERM] * 2


@pytest.mark.launch
def test_a_rank_that_exited_first_is_no_job_ended_from_outside():
    """Rank 1 exits 2 (as on bad input: no error record, the interpreter's exit), then the launcher stops rank 0:
    rank 0 says it was stopped and claims nothing about who failed."""
    ranks = _ranks_of_two(rank_1_exits=True)
    try:
        for rank in ranks:
            assert rank.stdout.readline().strip() == "started"
        assert ranks[1].wait(timeout=15) == 2
        ranks[0].send_signal(signal.SIGTERM)
        _, stderr = ranks[0].communicate(timeout=15)
    finally:
        for rank in ranks:
            rank.kill()
    assert [line for line in stderr.splitlines() if line.startswith("error: rank")] == [
        "error: rank 0 stopped by SIGTERM"], stderr
    assert ranks[0].returncode == 128 + signal.SIGTERM
