"""No silent zeros: GEMM-class ops without a torch formula get one from their shapes, what is still
uncounted is listed (report JSON and printout), and the grad mode does not change the count."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from patches.profiler.files import validate_report
from patches.profiler.module_profiler import ModuleProfiler, UncountedOp
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from tests.test_profiler_report import make_meta, rank_entries


def _profile(module, *inputs, context=contextlib.nullcontext):
    profiler = ModuleProfiler(module)
    profiler.start()
    with context():
        module(*inputs)
    profiler.stop()
    profiler.remove()
    return profiler.tree()["fwd_flops"], profiler.uncounted_ops()


class Call(torch.nn.Module):
    def __init__(self, fn, *children):
        super().__init__()
        self.fn = fn
        self.layers = torch.nn.ModuleList(children)

    def forward(self, *inputs):
        return self.fn(self, *inputs)


def test_mv_addmv_addbmm_dot_have_formulas():
    mat, vec = torch.randn(3, 4), torch.randn(4)
    batch1, batch2 = torch.randn(5, 3, 4), torch.randn(5, 4, 6)
    assert _profile(Call(lambda self, m, v: torch.mv(m, v)), mat, vec) == (2 * 3 * 4, [])
    assert _profile(Call(lambda self, m, v: torch.addmv(torch.ones(3), m, v)), mat, vec) == (2 * 3 * 4, [])
    assert _profile(Call(lambda self, a, b: torch.addbmm(torch.ones(3, 6), a, b)), batch1, batch2) == (
        2 * 5 * 3 * 4 * 6, [])
    assert _profile(Call(lambda self, v: torch.dot(v, v)), vec) == (2 * 4, [])


@pytest.mark.parametrize("self_shape, mat2_shape, offsets, expected", [
    ((8, 8), (2, 8, 16), [3, 8], 2 * 8 * 8 * 16),  # tokens sliced over 2 experts
    ((2, 4, 8), (2, 8, 16), None, 2 * 2 * 4 * 8 * 16),  # batched
])
def test_grouped_mm_has_a_formula(self_shape, mat2_shape, offsets, expected):
    a, b = torch.randn(*self_shape), torch.randn(*mat2_shape)
    offs = torch.tensor(offsets, dtype=torch.int32) if offsets else None
    try:
        torch._grouped_mm(a, b, offs)
    except RuntimeError as error:  # a CPU build without this kernel layout
        pytest.skip(f"_grouped_mm unavailable here: {error}")
    assert _profile(Call(lambda self, x, y: torch._grouped_mm(x, y, offs)), a, b) == (expected, [])


def test_uncounted_matrix_ops_are_listed_per_phase():
    """aten.addr (a rank-1 update) has no formula: listed with its calls and phase, never a silent 0."""
    weight = torch.randn(3, 4, requires_grad=True)

    def forward(self, u, v):
        return (torch.addr(weight, u, v) + torch.addr(weight, u, v)).sum()

    module = Call(forward)
    profiler = ModuleProfiler(module)
    profiler.start()
    module(torch.randn(3, requires_grad=True), torch.randn(4)).backward()
    profiler.stop()
    uncounted = profiler.uncounted_ops()
    assert UncountedOp(op="aten.addr.default", phase="fwd", calls=2) in uncounted
    assert all(op.phase in ("fwd", "bwd") for op in uncounted)
    profiler.reset()
    assert profiler.uncounted_ops() == []


def _mixed_model():
    """Composite ops that inference_mode hands to the dispatch mode whole, and the MHA / encoder-layer fast
    paths that no_grad takes."""
    encoder = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    attention = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    conv = torch.nn.Conv2d(1, 2, 3)
    weight = torch.randn(16, 16)

    def forward(self, x):
        y = self.layers[0](x)
        y = y + self.layers[1](y, y, y, need_weights=False)[0]
        y = F.linear(y, weight) + torch.matmul(y, weight) + torch.einsum("bld,de->ble", y, weight)
        return self.layers[2](y[:, None]).sum()

    return Call(forward, encoder, attention, conv)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_grad_mode_does_not_change_the_count(context):
    model = _mixed_model()
    x = torch.randn(2, 5, 16)
    with_grad = _profile(model, x)
    assert with_grad[1] == [] and with_grad[0] > 0
    assert _profile(model, x, context=context) == with_grad


def test_report_lists_uncounted_ops_and_the_printout_says_so():
    entries = rank_entries()
    entries[0]["uncounted_ops"] = [{"op": "aten.addr.default", "phase": "fwd", "calls": 2}]
    entries[1]["uncounted_ops"] = [{"op": "aten.addr.default", "phase": "fwd", "calls": 2}]
    report = build_report(entries, make_meta())
    validate_report(report)
    replica_calls = sum(2 for e in entries[:2] if e["dp_rank"] == 0)
    assert report["uncounted_ops"] == [{"op": "aten.addr.default", "phase": "fwd", "calls": replica_calls}]
    text = format_report(report)
    assert "uncounted ops:" in text and f"aten.addr.default x{replica_calls} (fwd)" in text
    assert ">= " in next(line for line in text.splitlines() if line.startswith("fwd flops of model"))
    assert ">= " not in next(line for line in text.splitlines() if line.startswith("bwd flops of model"))


def test_report_without_uncounted_ops_prints_exact_numbers():
    report = build_report(rank_entries(), make_meta())
    assert report["uncounted_ops"] == []
    assert "uncounted ops" not in format_report(report) and ">= " not in format_report(report)


def test_report_says_when_the_profiled_step_was_skipped():
    meta = make_meta()
    assert build_report(rank_entries(), meta)["optimizer_step_skipped"] is False
    meta["optimizer_step_skipped"] = True
    report = build_report(rank_entries(), meta)
    validate_report(report)
    assert report["optimizer_step_skipped"] is True
    assert "skipped (fp16 loss-scale overflow)" in format_report(report)
