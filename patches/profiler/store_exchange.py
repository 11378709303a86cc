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
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from patches.profiler.stragglers import RankSample

# A stage that profiled the same train_batch publishes within moments of this one (train_batch ends with
# the pipeline's loss broadcast, which every stage enters); this long, a missing stage is one that did not.
MIN_WAIT_S = 5.0
POLL_S = 0.02


def requires() -> list:
    """The private torch name this exchange uses: the default group's store."""
    return [(c10d, "_get_default_store")]


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


def _key(namespace: str, rank: int) -> str:
    return f"patches/flops_profile/{namespace}/rank{rank}"


def publish(namespace: str, publication: Publication) -> None:
    c10d._get_default_store().set(_key(namespace, publication.global_rank), pickle.dumps(publication))


@dataclass
class Collected:
    found: Dict[int, Publication]
    missing: List[int]  # ranks that published nothing within the wait


def collect(namespace: str, ranks: List[int], wait_s: float) -> Collected:
    """Every rank's publication of `namespace` that arrives within wait_s (at least MIN_WAIT_S)."""
    store = c10d._get_default_store()
    deadline = time.monotonic() + max(wait_s, MIN_WAIT_S)
    pending = list(ranks)
    found = {}
    while True:
        for rank in list(pending):
            if store.check([_key(namespace, rank)]):
                found[rank] = pickle.loads(store.get(_key(namespace, rank)))
                pending.remove(rank)
        if not pending or time.monotonic() > deadline:
            return Collected(found, pending)
        time.sleep(POLL_S)


def world_ranks() -> List[int]:
    return list(range(dist.get_world_size()))


def every_ranks(namespace: str, value: Any) -> List[Any]:
    """Every world rank's `value` for `namespace`, in rank order, once all have published theirs: each rank sets
    its own key of the default group's store and waits for the others' (no collective, so a rank that fails
    before publishing leaves nobody inside one). Every rank of the world must call it with the same namespace."""
    store = c10d._get_default_store()
    store.set(_key(namespace, dist.get_rank()), pickle.dumps(value))
    keys = [_key(namespace, rank) for rank in world_ranks()]
    store.wait(keys)
    return [pickle.loads(store.get(key)) for key in keys]
