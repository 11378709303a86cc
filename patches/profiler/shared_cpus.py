"""A CPU run whose ranks share fewer CPUs than they run threads: how much of their compute time the stages were
running, measured from the profiled iteration, for the plan (partition/planner.py: SharedCpus).

Four ranks of one thread on two CPUs run at most two at a time: while three compute, each runs two thirds of the
time and waits for a core the rest, so a stage's measured time holds waits that another cut would not have, and
however the layers are cut the host's CPUs must do all their work. Each rank says where it ran (RankEntry: its
host, the CPUs it may run on, torch's threads, the launcher's count of the job's ranks on its host); over the
replica's forward and backward instructions, each running rank runs at the rate the host can give it, min(1, CPUs
/ threads of the ranks running), and `share` is the work so done over the time those instructions took;
`forward_share`, the forward instructions' part of that time. The plan then runs the schedule on those CPUs
(partition/shared_schedule.py), each stage's work its measured time times `share`.

Measured only where it can be: a CPU device; every rank of the job on one host (the replica's ranks there, and the
other replicas too where the launcher says how many ranks it started on the host: each replica runs as replica 0
does); the same CPUs for each rank (ranks pinned apart have no CPU to share). Elsewhere None, and the plan is the
pipeline model alone.
"""
from typing import Iterator, List, Optional, Tuple

from patches.partition.planner import SharedCpus
from patches.profiler.instructions import BACKWARD_INSTRUCTIONS, FORWARD_INSTRUCTIONS

COMPUTE_INSTRUCTIONS = FORWARD_INSTRUCTIONS + BACKWARD_INSTRUCTIONS


def shared_cpus_of(replica: List[dict], tp: int, dp: int, device_name: str) -> Optional[SharedCpus]:
    """The replica's entries (RankEntry.as_dict) -> SharedCpus, or None where the ranks do not share too few CPUs
    or it cannot be told (see the module docstring)."""
    if device_name != "cpu" or not replica or any(not entry.get("cpus") for entry in replica):
        return None
    if len({entry["host"] for entry in replica}) != 1 or len({tuple(entry["cpus"]) for entry in replica}) != 1:
        return None
    world = len(replica) * dp
    if dp > 1 and any(entry.get("host_ranks") != world for entry in replica):
        return None  # the other replicas' ranks may be elsewhere
    cpus, threads = len(replica[0]["cpus"]), max(entry["threads"] for entry in replica)
    if world * threads <= cpus:
        return None
    share = _running_share(replica, threads * dp, cpus)
    if share is None:
        return None
    return SharedCpus(cpus=cpus, ranks=world, threads=threads, ranks_per_stage=tp * dp, share=share,
                      forward_share=_forward_share(replica))


def _running_share(replica: List[dict], threads_per_rank: int, cpus: int) -> Optional[float]:
    """Over the replica's compute instructions (on one clock), the work each running rank did at the rate the CPUs
    give it, over the time it took. threads_per_rank: the threads a running replica rank stands for (every
    replica's rank at that place runs alike)."""
    edges = []  # (time, +1 a rank starts computing / -1 it stops)
    for _, start, end in _compute_spans(replica):
        edges += [(start, 1), (end, -1)]
    edges.sort()
    running, work, wall, previous = 0, 0.0, 0.0, None
    for time, change in edges:
        if running and previous is not None:
            seconds = time - previous
            wall += running * seconds
            work += running * seconds * min(1.0, cpus / (running * threads_per_rank))
        running, previous = running + change, time
    return work / wall if wall > 0 else None


def _forward_share(replica: List[dict]) -> float:
    """The forward instructions' part of the replica's compute instructions' time (some compute ran: the share did)."""
    seconds = {True: 0.0, False: 0.0}
    for name, start, end in _compute_spans(replica):
        seconds[name in FORWARD_INSTRUCTIONS] += end - start
    return seconds[True] / (seconds[True] + seconds[False])


def _compute_spans(replica: List[dict]) -> Iterator[Tuple[str, float, float]]:
    """Each compute instruction that took time on any of the replica's ranks: (name, start, end) on one clock."""
    for entry in replica:
        offset = entry["clock_offset_s"]
        for name, _, start, end in entry["events"]:
            if name in COMPUTE_INSTRUCTIONS and end > start:
                yield name, start - offset, end - offset
