"""patches.process.clean_exit: the teardown that ends a finished run's process groups before the interpreter finalizes
(why: its docstring), registered by patches.launch for a user's own Megatron-DeepSpeed, and by our fork with its
layout's release added. One in-process gloo group of one rank (a file store: no port, no process started)."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch.distributed as dist

import patches.profiler.gather as gather
from megatron import clean_exit as fork_clean_exit
from patches.process import clean_exit
from patches.profiler.attachment import attachment_of
from tests.helpers.launch import REPO


def _one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)


def test_the_teardown_ends_the_groups_and_forgets_every_holder_it_knows(tmp_path, monkeypatch):
    _one_rank_gloo(tmp_path)
    group = dist.new_group([0], backend="gloo")
    grid = types.SimpleNamespace(pp_group=[0], dp_proc_group=group)  # as pipe.p2p's grid holds its groups
    holder = types.ModuleType("deepspeed.utils.groups")
    holder.__dict__.update(_WORLD_GROUP=group, _EXPERT_PARALLEL_GROUP={"ep": group}, _ALL_TO_ALL_GROUP={},
                           mpu=types.ModuleType("megatron.core.mpu"), keep=[1, 2])
    p2p = types.ModuleType("deepspeed.runtime.pipe.p2p")
    p2p.__dict__.update(_grid=grid, _groups=[group])
    monkeypatch.setitem(sys.modules, "deepspeed.utils.groups", holder)
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.pipe.p2p", p2p)
    engine = types.SimpleNamespace()  # an engine the script still reaches, with its report groups
    attachment_of(engine).report_groups = gather.ReportGroups(None, None, group)
    calls = []

    clean_exit.teardown_process_groups(lambda: calls.append(dist.is_initialized()))

    assert not dist.is_initialized()
    assert calls == [False]  # the caller's release runs once, after the destroy
    assert attachment_of(engine).report_groups is None
    assert holder._WORLD_GROUP is None and holder._EXPERT_PARALLEL_GROUP == {}
    assert isinstance(holder.mpu, types.ModuleType) and holder.keep == [1, 2]  # a module and plain data stay
    assert p2p._grid is None and p2p._groups is None


def test_the_teardown_without_process_groups_only_collects():
    assert not dist.is_initialized()
    clean_exit.teardown_process_groups()
    assert not dist.is_initialized()


def test_the_fork_adds_its_layout_to_the_teardown(tmp_path):
    from megatron import mpu

    _one_rank_gloo(tmp_path)
    mpu.initialize_model_parallel(1, 1)
    fork_clean_exit.teardown_process_groups()
    assert not dist.is_initialized() and not mpu.model_parallel_is_initialized()


def test_patches_launch_registers_the_teardown_once():
    """What `python -m patches.launch` (and the one-line edit, apply_to_this_run) does: one at-exit handler, also
    when both ask."""
    code = ("import atexit, patches; patches.apply(); before = atexit._ncallbacks(); "  # DeepSpeed's own first
            "patches.apply_to_this_run([]); patches.apply_to_this_run([]); "
            "print('added', atexit._ncallbacks() - before)")
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.splitlines()[-1] == "added 1"


# A DataLoader iterator with 2 workers in a reference cycle (as the training loop's data iterator sits), one
# batch taken, then what the teardown does. torch's join timeout is cut to 0.2 s, so the old way's wait is short;
# each worker join is recorded with whether the worker was still alive after it.
_DATA_LOADER_AT_EXIT = """
import json, sys, torch, torch.utils.data as data
from torch.utils.data import _utils as data_utils
from patches.process import clean_exit
data_utils.MP_STATUS_CHECK_INTERVAL = 0.2
joins = []
import multiprocessing.process as mp_process
real_join = mp_process.BaseProcess.join
def join(self, timeout=None):
    real_join(self, timeout)
    joins.append(self.is_alive())
mp_process.BaseProcess.join = join
holder = {}
holder["iterator"] = iter(data.DataLoader(list(range(64)), batch_size=4, num_workers=2))
holder["self"] = holder  # the cycle
next(holder["iterator"])
workers = [w.pid for w in holder["iterator"]._workers]
del holder
getattr(clean_exit, sys.argv[1])()
print(json.dumps({"joins": joins, "workers": workers}))
"""


def _data_loader_at_exit(teardown):
    process = subprocess.run([sys.executable, "-c", _DATA_LOADER_AT_EXIT, teardown], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(process.stdout.splitlines()[-1])


@pytest.mark.launch  # two interpreters, each with 2 DataLoader worker processes
def test_at_exit_the_teardown_leaves_data_loader_workers_to_the_exit():
    """The teardown's gc.collect() finalizes the iterator after its index queues' own finalizers closed them: the
    stop never reaches a worker, and torch waits out its join timeout for each (5 s: every run with workers exited
    10 s late). At exit the iterator is told the interpreter is exiting first: no join, and multiprocessing's exit
    ends the daemonic workers with the process."""
    collected = _data_loader_at_exit("teardown_process_groups")  # the collect alone: each worker outlives its join
    assert collected["joins"][:2] == [True, True], collected  # then torch ends them itself
    at_exit = _data_loader_at_exit("_teardown_at_exit")
    assert at_exit["joins"] == [], at_exit
    for pid in at_exit["workers"]:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read(), pid
