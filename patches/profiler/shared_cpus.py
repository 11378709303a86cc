"""A CPU run whose ranks share fewer CPUs than they run threads, or whose CPUs slow each other when busy at once:
how much of their compute time each stage did at full speed, measured from the profiled iteration, for the plan
(partition/planner.py: SharedCpus).

Four ranks of one thread on two CPUs run at most two at a time: while three compute, each runs two thirds of the
time and waits for a core the rest, so a stage's measured time holds waits that another cut would not have, and
however the layers are cut the host's CPUs must do all their work. CPUs enough may still slow each other: two threads
of one core, or a virtual machine's CPUs whose host is busy, each run slower while the other computes (each rank's
together_rate, measured when the report is gathered: host_contention.py). Each rank says where it ran (RankEntry:
its host, the CPUs it may run on, torch's threads, the launcher's count of the job's ranks on its host); over the
replica's forward and backward instructions, each running rank runs at the rate the host can give it
(shared_schedule.running_rate: the CPUs shared among the threads running, each slowed by the ranks' median
together_rate as they fill), and `share` is the work so done over the time those instructions took, `stage_shares`
the same for each stage's ranks; `forward_share`, the forward instructions' part of that time. The plan then takes
each layer's and overhead's seconds at full speed (its stage's share) and runs the schedule on those CPUs
(partition/shared_schedule.py).

Measured only where it can be: a CPU device; every rank of the job on one host (the replica's ranks there, and the
other replicas too where the launcher says how many ranks it started on the host: each replica runs as replica 0
does); the same CPUs for each rank (ranks pinned apart have no CPU to share). Elsewhere None, and the plan is the
pipeline model alone; so too where the CPUs were enough and the ranks did not slow each other (a together_rate of
1), or a report from before the rate was measured, where `share` alone is kept.
"""
import statistics
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from patches.partition.planner import SharedCpus
from patches.partition.shared_schedule import running_rate
from patches.profiler.instructions import BACKWARD_INSTRUCTIONS, FORWARD_INSTRUCTIONS

COMPUTE_INSTRUCTIONS = FORWARD_INSTRUCTIONS + BACKWARD_INSTRUCTIONS


def shared_cpus_of(replica: List[dict], tp: int, dp: int, device_name: str) -> Optional[SharedCpus]:
    """The replica's entries (RankEntry.as_dict) -> SharedCpus, or None where the ranks neither share too few CPUs
    nor were measured slowing each other, or it cannot be told (see the module docstring)."""
    if device_name != "cpu" or not replica or any(not entry.get("cpus") for entry in replica):
        return None
    if len({entry["host"] for entry in replica}) != 1 or len({tuple(entry["cpus"]) for entry in replica}) != 1:
        return None
    world = len(replica) * dp
    if dp > 1 and any(entry.get("host_ranks") != world for entry in replica):
        return None  # the other replicas' ranks may be elsewhere
    cpus, threads = len(replica[0]["cpus"]), max(entry["threads"] for entry in replica)
    rates = [entry.get("together_rate") for entry in replica]
    together = statistics.median(rates) if all(rate is not None for rate in rates) else None
    if world * threads <= cpus and (together is None or together >= 1.0):
        return None
    busy = min(world * threads, cpus)

    def rate(running: int) -> float:  # each running replica rank stands for dp ranks of `threads` threads
        return running_rate(running * threads * dp, cpus, together if together is not None else 1.0, busy)

    shares = _running_shares(replica, rate)
    if shares is None:
        return None
    share, stage_shares = shares
    return SharedCpus(cpus=cpus, ranks=world, threads=threads, ranks_per_stage=tp * dp, share=share,
                      forward_share=_forward_share(replica), together_rate=together,
                      stage_shares=stage_shares if together is not None else None)


def _running_shares(replica: List[dict], rate: Callable[[int], float]) -> Optional[Tuple[float, List[float]]]:
    """Over the replica's compute instructions (on one clock), the work each running rank did at rate(ranks
    running), over the time it took: for them all, and for each stage's ranks (1 for a stage that computed
    nothing); None where none computed."""
    edges = []  # (time, +1 a rank starts computing / -1 it stops, its place in the replica)
    for place, entry in enumerate(replica):
        for _, start, end in _compute_spans([entry]):
            edges += [(start, 1, place), (end, -1, place)]
    edges.sort()
    running: Dict[int, int] = {}  # place -> its compute instructions under way (one, unless they touch)
    work, wall = [0.0] * len(replica), [0.0] * len(replica)
    previous = None
    for time, change, place in edges:
        if running and previous is not None:
            seconds, speed = time - previous, rate(len(running))
            for busy in running:
                wall[busy] += seconds
                work[busy] += seconds * speed
        running[place] = running.get(place, 0) + change
        if not running[place]:
            del running[place]
        previous = time
    if sum(wall) <= 0:
        return None
    stages = max(entry["stage_id"] for entry in replica) + 1
    stage_work, stage_wall = [0.0] * stages, [0.0] * stages
    for entry, done, took in zip(replica, work, wall):
        stage_work[entry["stage_id"]] += done
        stage_wall[entry["stage_id"]] += took
    return (sum(work) / sum(wall),
            [done / took if took > 0 else 1.0 for done, took in zip(stage_work, stage_wall)])


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
