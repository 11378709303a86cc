"""How often a run's exit goes wrong: many short two-rank launches, counting at-exit aborts and ranks
that name the wrong rank as the one that failed. Not part of CI: it takes minutes.

    python bench/exit_races.py                      # 200 launches of this checkout's megatron
    python bench/exit_races.py --launches 50 --code-root /path/to/another/checkout   # e.g. before a change

Each launch forks two ranks (gloo on 127.0.0.1) from this process, which imported torch and megatron
once: a launch then costs well under a second instead of two torch imports. The ranks set up as
pretrain_gpt.py does
(megatron.clean_exit's at-exit teardown, then megatron.liveness's heartbeat), run a few collectives, on
the default group and on a group only a reference cycle holds (as an engine and its grid do), and end:
- "ok" launches: both ranks exit normally; each must exit 0 (an abort is exit -6 / "terminate called").
- "raise" launches: rank 1 raises after the last collective while rank 0 exits normally, taking the
  rendezvous store with it; rank 1 must exit 1 saying "error: rank 1 failed", never naming rank 0.
Launches alternate between the two. No DeepSpeed: the groups it would hold are modelled by the cycle.
"""
import argparse
import os
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TIMEOUT_S = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- one rank
class _Holder:
    """Holds a process group from inside a reference cycle, as a DeepSpeed engine and its grid do."""

    def __init__(self, group):
        self.group = group
        self.me = self


def rank_main(scenario):
    import torch
    import torch.distributed as dist

    from megatron import clean_exit, liveness

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    clean_exit.at_exit()  # registered before the heartbeat, as megatron.initialize does
    liveness.start(rank, dist.get_world_size())
    holder = _Holder(dist.new_group([0, 1]))
    tensor = torch.ones(4096)
    for _ in range(8):
        dist.all_reduce(tensor)
        dist.all_reduce(tensor, group=holder.group)
    dist.all_reduce(tensor, async_op=True).wait()
    del holder  # only the cycle holds the group now
    if scenario == "raise" and rank == 1:
        try:
            raise RuntimeError("injected error on rank 1")
        except RuntimeError as error:
            liveness.exit_after_failure(error)


# ---------------------------------------------------------------- the loop
def launch(scenario, code_root):
    """Two ranks forked from this process (torch and megatron imported once, here, before any thread):
    each runs rank_main and then exits as a script does, through the interpreter's normal finalization
    (SystemExit unwinds to the top), which is where the at-exit abort happens. [(exit code, output)]."""
    port = free_port()
    children = []
    for rank in range(2):
        log = tempfile.TemporaryFile(mode="w+")
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            rank_main(scenario)
            raise SystemExit(0)
        children.append((pid, log))
    results = []
    deadline = time.monotonic() + TIMEOUT_S
    for pid, log in children:
        status = _wait(pid, deadline)
        log.seek(0)
        output = log.read() + ("\n(timed out)" if status is None else "")
        log.close()
        results.append((-9 if status is None else os.waitstatus_to_exitcode(status), output))
    return results


def _wait(pid, deadline):
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def verdict(scenario, results):
    """(aborts, misnamed ranks, one line on what went wrong or None)."""
    aborts = sum(1 for code, output in results if code < 0 or code == 134 or "terminate called" in output
                 or "(timed out)" in output)
    misnamed = 0
    problems = []
    for rank, (code, output) in enumerate(results):
        lines = re.findall(r"error: rank \d+ [^\n]*", output)
        if scenario == "ok" and code != 0:
            problems.append(f"rank {rank} exit {code}")
        if scenario == "raise" and rank == 1:
            named_itself = len(lines) == 1 and lines[0].startswith("error: rank 1 failed")
            if not named_itself:
                misnamed += 1
                problems.append(f"rank 1 said {lines}")
            if code != 1 and code >= 0:
                problems.append(f"rank 1 exit {code}")
        if scenario == "raise" and rank == 0 and any("rank 0 failed" in line for line in lines):
            misnamed += 1
            problems.append(f"rank 0 said {lines}")
    if aborts:
        problems.append(f"exit codes {[code for code, _ in results]}")
    return aborts, misnamed, "; ".join(problems) or None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--code-root", default=str(HERE.parents[1]), help="checkout whose megatron the ranks import")
    options = parser.parse_args()
    sys.path.insert(0, options.code_root)
    import torch.distributed  # noqa: F401  (imported once, before the forks)

    from megatron import clean_exit, liveness  # noqa: F401
    counts = {"ok": [0, 0, 0], "raise": [0, 0, 0]}  # launches, aborts, misnamed ranks
    started = time.time()
    for index in range(options.launches):
        scenario = ("ok", "raise")[index % 2]
        aborts, misnamed, problem = verdict(scenario, launch(scenario, options.code_root))
        counts[scenario][0] += 1
        counts[scenario][1] += aborts
        counts[scenario][2] += misnamed
        if problem:
            print(f"launch {index} ({scenario}): {problem}", flush=True)
    elapsed = time.time() - started
    print(f"code: {options.code_root}; {options.launches} launches in {elapsed:.0f} s; load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    for scenario, (launches, aborts, misnamed) in counts.items():
        print(f"{scenario:5s}: {launches} launches, {aborts} aborted ranks, {misnamed} misnamed ranks")
    total = [sum(c[i] for c in counts.values()) for i in range(3)]
    print(f"total: {total[0]} launches, {total[1]} aborts, {total[2]} misnamed ranks")


if __name__ == "__main__":
    main()
