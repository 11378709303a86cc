"""How much CPU ranks slow each other when they compute at once: each rank's speed with every rank computing,
relative to its speed alone, measured once when the report is gathered (RankEntry.together_rate).

Two ranks on two CPUs need not run as fast together as apart: the CPUs may be two threads of one core, share a
memory bus and a cache, or be a virtual machine's, whose host runs more than them (on the 2-CPU machines this
project is tested on, each of two ranks ran a matrix product 0.37x to 0.75x as fast while the other ran one too,
now and then as fast, as the host's other tenants came and went). A stage's measured time then depends on what the
other stages did meanwhile, and a cut that keeps the stages busy at the same time slows each of them. The plan runs
the schedule with that rate (partition/shared_schedule.py).

Every rank of the group takes a turn running a fixed matrix-product loop on one thread while the others wait at a
barrier (alone), then all run it at once (together), ROUNDS times; a rank's rate is its median time alone over its
median time together. Collective over the group: every rank enters it, or none (a CPU run of at most MAX_RANKS
ranks; the caller decides from what every rank knows alike). About ROUNDS x (ranks + ranks x slowdown) x the loop's
time: 0.5 to 0.6 s at 2 ranks and 1.1 to 1.2 s at 4 on this project's 2-CPU test machines (busy with another
job), spent once, after the measured iterations, when the report is gathered.
"""
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

ROUNDS = 3  # the machine's other tenants come and go: a rate from a second of products, not a moment
PRODUCTS = 80  # of SIZE x SIZE float matrices: 35 to 80 ms alone on one thread of this project's test machines
SIZE = 256
MAX_RANKS = 64  # above this the turns alone would take seconds: not measured


def _loop_s(left: torch.Tensor, right: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(PRODUCTS):
        torch.mm(left, right)
    return time.perf_counter() - start


def together_rate(group: Optional[dist.ProcessGroup] = None) -> Optional[float]:
    """This rank's speed with every rank of `group` computing, over its speed alone (1.0: no slowdown); None where
    the group is larger than MAX_RANKS (every rank returns None alike). Collective over `group`."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    if ranks > MAX_RANKS:
        return None
    generator = torch.Generator().manual_seed(0)  # its own: the job's random state is left as it was
    left, right = (torch.rand(SIZE, SIZE, generator=generator) for _ in range(2))
    threads = torch.get_num_threads()
    # one thread: a CPU's speed alone and with the others busy (the plan scales by the ranks' threads itself); a
    # rank of several threads waiting at the barrier would keep its idle ones spinning on the CPUs being timed
    torch.set_num_threads(1)
    try:
        _loop_s(left, right)  # warm: the first products pay for the allocation and the library's set-up
        alone, together = [], []
        for _ in range(ROUNDS):
            for turn in range(ranks):
                dist.barrier(group=group)
                if turn == me:
                    alone.append(_loop_s(left, right))
            dist.barrier(group=group)
            together.append(_loop_s(left, right))
        dist.barrier(group=group)
    finally:
        torch.set_num_threads(threads)
    return min(1.0, statistics.median(alone) / statistics.median(together))
