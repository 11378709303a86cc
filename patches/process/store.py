"""Values every rank exchanges through the process group's key-value store: no collective, so no rank can be left
half-way through one. The store is the one torch.distributed rendezvoused with (rank 0's TCPStore), which every
rank already reaches. The profile's own publications (profiler/store_exchange.py) travel through it too."""
import pickle
from typing import Any, List

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def requires() -> list:
    """The private torch name the store is reached by: the default group's store."""
    return [(c10d, "_get_default_store")]


def default_store():
    return c10d._get_default_store()


def key(namespace: str, rank: int) -> str:
    return f"patches/flops_profile/{namespace}/rank{rank}"


def world_ranks() -> List[int]:
    return list(range(dist.get_world_size()))


def every_ranks(namespace: str, value: Any) -> List[Any]:
    """Every world rank's `value` for `namespace`, in rank order, once all have published theirs: each rank sets
    its own key of the default group's store and waits for the others' (no collective, so a rank that fails
    before publishing leaves nobody inside one). Every rank of the world must call it with the same namespace."""
    store = default_store()
    store.set(key(namespace, dist.get_rank()), pickle.dumps(value))
    keys = [key(namespace, rank) for rank in world_ranks()]
    store.wait(keys)
    return [pickle.loads(store.get(each)) for each in keys]
