"""Where a rank's process ran: its host, the CPUs it may run on, torch's threads and the job's ranks on that host
(the report's shared-CPU term reads them: ranks that share too few CPUs wait for a core, shared_cpus.py)."""
import os
import socket

import torch


def where_it_ran() -> dict:
    """RankEntry's host, cpus, threads and host_ranks: this host, the CPUs this process may run on, torch's threads,
    and the job's ranks on this host as torchrun (LOCAL_WORLD_SIZE) or DeepSpeed's launcher (LOCAL_SIZE) counts them."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return {"host": socket.gethostname(), "cpus": cpus, "threads": torch.get_num_threads(),
            "host_ranks": int(local) if local and local.isdigit() else None}
