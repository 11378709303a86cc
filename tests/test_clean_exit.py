"""patches.clean_exit: the teardown that ends a finished run's process groups before the interpreter finalizes
(why: its docstring), registered by patches.launch for a user's own Megatron-DeepSpeed, and by our fork with its
layout's release added. One in-process gloo group of one rank (a file store: no port, no process started)."""
import subprocess
import sys
import types

import torch.distributed as dist

import patches.profiler.gather as gather
from megatron import clean_exit as fork_clean_exit
from patches import clean_exit
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
