"""How much CPU ranks slow each other computing at once (patches/profiler/host_contention.py), measured by real
ranks over gloo (torch's spawn): every rank returns a rate in (0, 1], the job's random state as it was, and a group
larger than the probe measures returns None on every rank alike, entering no collective. The rate itself is the
machine's (tests/test_shared_cpus.py holds what the plan does with it, by hand)."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from patches.process import clean_exit
from patches.profiler import host_contention
from tests.helpers.launch import free_port


def _worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(1234 + rank)
        before = torch.get_rng_state()
        rate = host_contention.together_rate()
        same_random_state = bool(torch.equal(before, torch.get_rng_state()))
        host_contention.MAX_RANKS = 1  # a group larger than the probe measures: None, no collective entered
        too_many = host_contention.together_rate()
        dist.barrier()  # every rank still here: nobody waits in a barrier the others skipped
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"rate": rate, "same_random_state": same_random_state, "too_many": too_many}, f)
    finally:
        clean_exit.teardown_process_groups()


@pytest.mark.launch
def test_every_rank_measures_a_rate_and_leaves_the_random_state(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world)
    for rank in range(world):
        outcome = json.loads((tmp_path / f"{rank}.json").read_text())
        assert 0.0 < outcome["rate"] <= 1.0, outcome
        assert outcome["same_random_state"] is True and outcome["too_many"] is None, outcome
