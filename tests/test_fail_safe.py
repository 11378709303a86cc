"""The profiler never ends a run (patches/profiler/fail_safe.py, held_state.py's reading of storages), in one
process: tensors whose storage cannot be read are no storage, and what fails of the profiler's own work inside the
iteration is a fault recorded, while the work it wraps runs once and raises what it raises."""
import contextlib
import gc
import json

import pytest
import torch
import torch.nn as nn

import patches.profiler.kept_activations as kept_activations
from patches.profiler.allocator_trace import CpuAllocatorRecorder
from patches.profiler.fail_safe import MEMORY, FaultLog, MeasurementFault
from patches.profiler.held_state import alive_storages, held_state, read_storage, storage_key
from patches.profiler.kept_activations import KeptActivations
from patches.profiler.printer import format_report
from patches.profiler.report_replica import measurement_faults
from tests.helpers.flags import PP2, TINY_GPT
from tests.helpers.launch import REPO, TORCHRUN, explain, launch, read_losses, run_pretrain
from tests.helpers.odd_tensors import compiled_with_fake_tensors, odd_tensors
from tests.helpers.tiny_gpt import check_totals

FLOAT = 4  # bytes of an fp32 element


# ---------------------------------------------------------------- reading storages
@pytest.mark.parametrize("kind", sorted(odd_tensors()))
def test_a_tensor_without_a_readable_storage_holds_none(kind):
    assert read_storage(odd_tensors()[kind]) is None and storage_key(odd_tensors()[kind]) is None


def test_a_fake_tensor_holds_none():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(1000)
    assert read_storage(fake) is None


def test_a_real_tensor_is_read_by_its_storage_and_bytes():
    base = torch.arange(10, dtype=torch.float64)
    view = base[2:5]
    read = read_storage(view)
    assert read.key == ("cpu", base.untyped_storage().data_ptr()) and read.nbytes == 80


def test_every_storage_alive_is_found_with_compiled_fake_tensors_and_odd_tensors_alive():
    compiled, odd = compiled_with_fake_tensors(), odd_tensors()
    fakes = [o for o in gc.get_objects() if type(o).__name__ == "FakeTensor"]
    assert fakes, "torch.compile left no fake tensor alive: this test no longer tests what it says"
    real = torch.empty(1234, dtype=torch.uint8)
    seen = []
    found = alive_storages("cpu", lambda storage, size: seen.append(size))
    assert found[("cpu", real.untyped_storage().data_ptr())] == 1234
    assert len(seen) == len(found) and sum(seen) == sum(found.values())
    assert compiled is not None and len(odd) == 4


def test_the_state_of_a_module_with_odd_tensors_counts_its_real_ones():
    model = nn.Linear(4, 2)
    model.register_buffer("meta_buffer", torch.empty(3, device="meta"))
    model.register_buffer("sparse_buffer", torch.randn(2, 2).to_sparse())
    state = held_state(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert state.param_bytes == (4 * 2 + 2) * 4 and state.optimizer_bytes == 0


def test_the_cpu_allocator_is_read_with_fake_tensors_alive():
    compiled = compiled_with_fake_tensors()
    recorder = CpuAllocatorRecorder()
    recorder.start()
    with recorder.instruction("ForwardPass", 0):
        kept = torch.empty(2000)  # + 8000
        compiled(torch.randn(4))  # the compiled function runs again, as the user's code may in an iteration
    trace = recorder.stop()
    assert recorder.not_read is None and kept.numel() == 2000
    forward = trace.instructions[0]
    assert forward.end - forward.start == 8000


# ---------------------------------------------------------------- the fault log
class Recorded:
    """A context of the profiler's own that fails where it is told to, and says what it saw."""

    def __init__(self, fail_on=None):
        self.fail_on = fail_on
        self.seen = []

    @contextlib.contextmanager
    def context(self):
        if self.fail_on == "enter":
            raise RuntimeError("entering failed")
        self.seen.append("entered")
        try:
            yield
        except BaseException as error:
            self.seen.append(f"saw {error}")
            raise
        if self.fail_on == "exit":
            raise ValueError("leaving failed\nwith a second line")
        self.seen.append("left")


@pytest.mark.parametrize("fail_on, fault", [
    (None, None),
    ("enter", MeasurementFault(MEMORY, "ForwardPass", "RuntimeError: entering failed")),
    ("exit", MeasurementFault(MEMORY, "ForwardPass", "ValueError: leaving failed"))])
def test_the_work_runs_once_whatever_the_context_around_it_does(fail_on, fault):
    faults, ours, ran = FaultLog(), Recorded(fail_on), []
    with faults.around(MEMORY, "ForwardPass", ours.context()):
        ran.append("work")
    assert ran == ["work"]
    assert faults.faults == ([fault] if fault else [])
    assert ours.seen == {None: ["entered", "left"], "enter": [], "exit": ["entered"]}[fail_on]


def test_the_works_own_error_is_raised_as_it_came_and_the_context_sees_it():
    faults, ours = FaultLog(), Recorded()
    error = LookupError("the user's")
    with pytest.raises(LookupError) as raised:
        with faults.around(MEMORY, "BackwardPass", ours.context()):
            raise error
    assert raised.value is error and ours.seen == ["entered", "saw the user's"] and faults.faults == []


def test_after_a_fault_the_part_is_off_and_the_first_fault_is_kept():
    faults, failing, later = FaultLog(), Recorded("enter"), Recorded()
    with faults.around(MEMORY, "ForwardPass", failing.context()):
        pass
    with faults.around(MEMORY, "BackwardPass", later.context()):
        pass
    with faults.guard(MEMORY, "stop"):
        raise OSError("a second fault")
    assert later.seen == [] and faults.failed(MEMORY)
    assert faults.faults == [MeasurementFault(MEMORY, "ForwardPass", "RuntimeError: entering failed")]


def test_a_guard_records_only_exceptions():
    faults = FaultLog()
    with pytest.raises(KeyboardInterrupt):
        with faults.guard(MEMORY, "start"):
            raise KeyboardInterrupt
    assert faults.faults == []


# ---------------------------------------------------------------- kept activations with a fault
class Layers(nn.Module):
    """Three layers run as a PipelineModule runs them: forward_funcs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.forward_funcs = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
        for position, layer in enumerate(self.forward_funcs):
            self.add_module(str(position), layer)

    def forward(self, x):
        for func in self.forward_funcs:
            x = func(x)
        return x


def _train(stage, measure):
    """Two micro-batches forward and backward; (outputs, input gradients, weight gradients)."""
    outputs, grads = [], []
    for seed in (1, 2):
        torch.manual_seed(seed)
        x = torch.randn(3, 8, requires_grad=True)
        out = stage(x)
        measure(out)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append(x.grad)
    return outputs, grads, [p.grad.clone() for p in stage.parameters()]


def test_a_layer_proxy_that_fails_leaves_the_layers_work_as_it_was(monkeypatch):
    plain = _train(Layers(), lambda out: None)
    stage, faults = Layers(), FaultLog()
    kept = KeptActivations(stage, faults)
    kept.attach()
    calls = []

    def failing_walk(outputs, stop):
        calls.append(len(calls))
        raise RuntimeError("a graph node of a kind it does not know")
    monkeypatch.setattr(kept_activations, "_saved_in_graph", failing_walk)
    measured = _train(stage, lambda out: None)
    kept.remove()
    for got, want in zip(measured, plain):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert faults.faults == [MeasurementFault(MEMORY, "layer 0's call",
                                              "RuntimeError: a graph node of a kind it does not know")]
    assert calls == [0]  # off after the first fault: the other layers and micro-batches only run


# ---------------------------------------------------------------- the report's lines
def test_the_report_names_each_fault_of_its_ranks_in_rank_order():
    replica = [{"global_rank": 1, "stage_id": 1, "tp_rank": 0,
                "faults": [{"part": MEMORY, "where": "ForwardPass", "error": "RuntimeError: injected"}]},
               {"global_rank": 0, "stage_id": 0, "tp_rank": 0, "faults": []},
               {"global_rank": 2, "stage_id": 0, "tp_rank": 1}]  # an entry from before faults were recorded
    assert measurement_faults(replica) == [{"part": MEMORY, "where": "ForwardPass", "error": "RuntimeError: injected",
                                            "global_rank": 1, "stage_id": 1, "tp_rank": 0}]


def test_a_golden_report_with_a_fault_prints_one_line_for_it():
    from tests.helpers.golden import golden_report

    report = golden_report("fork")
    report["measurement_faults"] = [{"part": MEMORY, "where": "ForwardPass", "error": "RuntimeError: injected",
                                     "global_rank": 1, "stage_id": 1, "tp_rank": 0}]
    lines = [line for line in format_report(report).splitlines() if line.startswith("not measured:")]
    assert len(lines) == 1 and " ".join(lines[0].split()) == (
        "not measured: memory of stage 1 (rank 1): failed in ForwardPass: RuntimeError: injected (the profiler's "
        "error: the iteration ran on, the rest of this report stands)")


# ---------------------------------------------------------------- launched: the run goes on
FAULT_SCRIPT = REPO / "tests" / "scripts" / "pretrain_with_fault.py"


@pytest.mark.launch
def test_odd_tensors_alive_and_a_memory_measurement_failing_on_one_rank_leave_the_run_as_it_was(tmp_path):
    """pp 2 with checkpointing, profiled at 2 (memory measured in 1, where the FLOPs are counted). Every rank keeps
    a torch.compile'd function (its fake tensors), a meta, a sparse and a storage-less tensor alive; rank 1's
    memory measurement raises at its second ForwardPass. The run trains as the plain one, bitwise, exits 0, and
    its report has every FLOP, stage 0's memory read, stage 1's missing and the fault named in one line."""
    flags = PP2 + ["--train-iters", "3", "--checkpoint-activations"]
    plain, plain_losses = run_pretrain(tmp_path, 2, flags, name="plain", via=TORCHRUN)
    assert plain.returncode == 0, explain(plain)
    out = tmp_path / "profile"
    env = {"FAULT_RANK": "1", "FAULT_ITERATION": "1", "FAULT_AT": "memory", "ODD_TENSORS": "1"}
    profiled = launch(FAULT_SCRIPT, 2, TINY_GPT + flags + [
        "--loss-record-file", tmp_path / "profiled_losses.jsonl", "--profile-flops-step", "2",
        "--profile-flops-output", out], cwd=tmp_path, env=env, via=TORCHRUN)
    assert profiled.returncode == 0, explain(profiled)
    assert sorted(plain_losses) == [1, 2, 3] and read_losses(tmp_path / "profiled_losses.jsonl") == plain_losses

    report = json.loads((out / "flops_profile_step2.json").read_text())
    check_totals(report, layers=4, sequences=8, checkpointing=True)
    assert report["measurement_faults"] == [{"part": MEMORY, "where": "ForwardPass",
                                             "error": "RuntimeError: injected fault on rank 1",
                                             "global_rank": 1, "stage_id": 1, "tp_rank": 0}]
    first, last = report["stages"]
    assert last["memory"] is None
    memory = first["memory"]
    assert memory["not_read"] is None and memory["measured_peak_bytes"] > memory["state_bytes"]
    assert memory["param_bytes"] == memory["grad_bytes"] == FLOAT * first["params_per_gpu"]
    said = [" ".join(line.split()) for line in profiled.stdout.splitlines() if line.startswith("not measured:")]
    assert said == ["not measured: memory of stage 1 (rank 1): failed in ForwardPass: RuntimeError: injected fault "
                    "on rank 1 (the profiler's error: the iteration ran on, the rest of this report stands)"]


# ---------------------------------------------------------------- a FLOP formula that fails
def test_an_op_whose_formula_raises_runs_once_and_is_listed_uncounted():
    from patches.profiler.flop_counting import FlopCountingMode

    credited, uncounted = [], []
    mode = FlopCountingMode(credited.append, uncounted.append, lambda func: None)

    def failing_formula(*args, out_val=None):
        raise TypeError("a shape it cannot read")
    mode.formulas[torch.ops.aten.mm.default] = failing_formula
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with mode:
        product = torch.mm(a, b)
        total = product.sum()
    assert torch.equal(product, a @ b) and torch.equal(total, (a @ b).sum())
    assert uncounted == [torch.ops.aten.mm.default] and credited == []


# ---------------------------------------------------------------- a module hook that fails
def test_a_module_hook_that_fails_leaves_the_work_as_it_was_and_no_results(monkeypatch):
    from patches.profiler.module_hooks import ModuleHooks, ModuleHooksFailed
    from patches.profiler.module_profiler import ModuleProfiler

    plain = _train(Layers(), lambda out: None)
    stage = Layers()
    profiler = ModuleProfiler.started(stage)
    original, entered = ModuleHooks.enter, []

    def enter(self, node, args, kwargs):
        entered.append(node.path)
        if len(entered) == 3:
            raise RuntimeError("a call it cannot describe")
        return original(self, node, args, kwargs)
    monkeypatch.setattr(ModuleHooks, "enter", enter)
    measured = _train(stage, lambda out: None)
    for got, want in zip(measured, plain):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(entered) == 3  # inert after the failure
    with pytest.raises(ModuleHooksFailed, match="the module profiler's forward pre-hook of 1 raised RuntimeError: "
                                                "a call it cannot describe"):
        profiler.finish()
    assert not stage._forward_pre_hooks and not stage._forward_hooks
    # the hooks stopped at the failure; the dispatch mode and the collector's callback still came off at finish
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not any(getattr(callback, "__self__", None) is profiler.gc_pauses for callback in gc.callbacks)
