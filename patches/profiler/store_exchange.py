"""Stage reports exchanged through the process group's key-value store: no collective, so no rank can be
left half-way through one.

DeepSpeed's FlopsProfiler API is driven by user code on whatever ranks it chooses (often one). Each rank
that profiled a train_batch publishes what it measured under a key of its own as soon as that
train_batch returns; a rank that wants the whole-pipeline report reads the keys it needs, waiting a
bounded time for each. A rank that never profiled publishes nothing and is named, never waited on
forever. The store is the one torch.distributed rendezvoused with (rank 0's TCPStore), which every
rank already reaches.
"""
import pickle
import socket
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from patches.process.store import default_store, key, world_ranks
from patches.profiler.stragglers import RankSample

__all__ = ["Publication", "Collected", "publish", "collect", "this_host_clock", "world_ranks"]

# A stage that profiled the same train_batch publishes within moments of this one (train_batch ends with
# the pipeline's loss broadcast, which every stage enters); this long, a missing stage is one that did not.
MIN_WAIT_S = 5.0
POLL_S = 0.02


@dataclass
class Publication:
    """What one rank measured in one profiled train_batch, as it travels through the store."""
    global_rank: int
    sample: RankSample  # every rank: the straggler scalars (or its failure)
    entry: Optional[dict]  # replica 0's ranks: RankEntry.as_dict(); None elsewhere or on failure
    module_events: Optional[list]  # replica 0's ranks: ModuleProfiler.events(), for the trace
    host: str
    wall_minus_perf_s: float  # time.time() - time.perf_counter(), read together: places this rank's clock


def this_host_clock() -> Tuple[str, float]:
    return socket.gethostname(), time.time() - time.perf_counter()


def publish(namespace: str, publication: Publication) -> None:
    default_store().set(key(namespace, publication.global_rank), pickle.dumps(publication))


@dataclass
class Collected:
    found: Dict[int, Publication]
    missing: List[int]  # ranks that published nothing within the wait


def collect(namespace: str, ranks: List[int], wait_s: float) -> Collected:
    """Every rank's publication of `namespace` that arrives within wait_s (at least MIN_WAIT_S)."""
    store = default_store()
    deadline = time.monotonic() + max(wait_s, MIN_WAIT_S)
    pending = list(ranks)
    found = {}
    while True:
        for rank in list(pending):
            if store.check([key(namespace, rank)]):
                found[rank] = pickle.loads(store.get(key(namespace, rank)))
                pending.remove(rank)
        if not pending or time.monotonic() > deadline:
            return Collected(found, pending)
        time.sleep(POLL_S)
