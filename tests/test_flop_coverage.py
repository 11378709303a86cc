"""No silent zeros: GEMM-class ops without a torch formula get one from their shapes, what is still
uncounted is listed (report JSON and printout), and the grad mode does not change the count."""
import contextlib
import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron.model.fused_layer_norm import RMSNorm as MegatronRMSNorm
from megatron.model.rotary import RotaryEmbedding
from patches.profiler.files import validate_report
from patches.profiler.module_profiler import ModuleProfiler, UncountedOp
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from tests.test_profiler_report import make_context, rank_entries


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
    report = build_report(entries, make_context())
    validate_report(report)
    replica_calls = sum(2 for e in entries[:2] if e["dp_rank"] == 0)
    assert report["uncounted_ops"] == [{"op": "aten.addr.default", "phase": "fwd", "calls": replica_calls}]
    text = format_report(report)
    assert "uncounted ops:" in text and f"aten.addr.default x{replica_calls} (fwd)" in text
    assert ">= " in next(line for line in text.splitlines() if line.startswith("fwd flops of model"))
    assert ">= " not in next(line for line in text.splitlines() if line.startswith("bwd flops of model"))


def test_report_without_uncounted_ops_prints_exact_numbers():
    report = build_report(rank_entries(), make_context())
    assert report["uncounted_ops"] == []
    assert "uncounted ops" not in format_report(report) and ">= " not in format_report(report)


def test_report_says_when_the_profiled_step_was_skipped():
    assert build_report(rank_entries(), make_context())["optimizer_step_skipped"] is False
    report = build_report(rank_entries(), make_context(optimizer_step_skipped=True))
    validate_report(report)
    assert report["optimizer_step_skipped"] is True
    assert "skipped (fp16 loss-scale overflow)" in format_report(report)


# ---------------------------------------------------------------- backward of mv and dot: the GEMM rule
def _profile_fwd_bwd(module, *inputs):
    profiler = ModuleProfiler(module)
    profiler.start()
    module(*inputs).backward()
    profiler.stop()
    profiler.remove()
    totals = profiler.totals()
    return totals["fwd_flops"], totals["bwd_flops"], profiler.uncounted_ops()


def _mv_dot_inputs():
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(*shape, generator=generator, requires_grad=True) for shape in ((5, 7), (7,), (9,), (9,))]


def test_mv_and_dot_backward_follow_the_gemm_rule():
    """mv of a 5 x 7 matrix, dot of length 9. Forward: 2*5*7 + 2*9 = 88. Backward, each gradient a GEMM at 2
    FLOPs per multiply-add: mv's matrix gradient (the outer product grad x vec, aten.mul in MvBackward0) 70,
    its vector gradient (mat^T mv grad) 70, dot's two gradients (0-d grad times the other vector) 18 each:
    176 = 2 x 88."""
    module = Call(lambda self, m, v, a, b: torch.mv(m, v).sum() + torch.dot(a, b))
    assert _profile_fwd_bwd(module, *_mv_dot_inputs()) == (88, 176, [])

    # torch's own counter has a formula for mm: the same products written as mm give the same figures.
    def as_mm(m, v, a, b):
        return (m @ v[:, None]).sum() + (a[None] @ b[:, None]).sum()

    forward_only, whole_step = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with forward_only:
        as_mm(*_mv_dot_inputs())
    with whole_step:
        as_mm(*_mv_dot_inputs()).backward()
    assert forward_only.get_total_flops() == 88
    assert whole_step.get_total_flops() - forward_only.get_total_flops() == 176


def test_addmv_backward_counts_its_gemms_not_the_alpha_scaling():
    """addmv(bias, 5 x 7, 7-vector, alpha=2, beta=3): forward 70; backward outer product 70 + mat^T mv 70;
    the alpha and beta scalings (aten.mul.Scalar) and the bias gradient are element-wise work."""
    mat, vec = _mv_dot_inputs()[:2]
    bias = torch.randn(5, requires_grad=True)
    module = Call(lambda self, c, m, v: torch.addmv(c, m, v, alpha=2, beta=3).sum())
    assert _profile_fwd_bwd(module, bias, mat, vec) == (70, 140, [])


def test_element_wise_products_outside_gemm_backward_count_nothing():
    x = torch.randn(5, 1, requires_grad=True)
    y = torch.randn(7, requires_grad=True)
    assert _profile_fwd_bwd(Call(lambda self, a, b: (a * b).sum()), x, y) == (0, 0, [])


# ---------------------------------------------------------------- nested tensors
def _nested_encoder():
    """nn.TransformerEncoder in eval mode with a padding mask: PyTorch turns the batch into a nested tensor."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 2 + [True] * 3])
    return model, torch.randn(3, 5, 16), mask


# Run in a fresh interpreter after _nested_encoder's source (the interpreter must not import patches.profiler
# before its first count, so it cannot import this module).
_TORCH_COUNTER_BEFORE_AND_AFTER = """
import json, sys, warnings
from torch.utils.flop_counter import FlopCounterMode

def count():
    model, x, mask = _nested_encoder()
    counter = FlopCounterMode(display=False)
    with warnings.catch_warnings(), torch.no_grad(), counter:
        warnings.simplefilter("ignore")  # nested tensors' prototype warning
        model(x, src_key_padding_mask=mask)
    return counter.get_total_flops()

assert "patches.profiler" not in sys.modules
before = count()
import patches.profiler.flop_formulas  # registers our formulas into torch's registry
from torch.utils.flop_counter import flop_registry
assert torch.ops.aten._transformer_encoder_layer_fwd in flop_registry
print(json.dumps({"before": before, "after": count()}))
"""


def test_torch_flop_counter_counts_a_nested_encoder_the_same_before_and_after_our_import():
    """A fresh interpreter: torch's FlopCounterMode on the nested fast path, then our import, then again."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))
    script = "import torch\n" + inspect.getsource(_nested_encoder) + _TORCH_COUNTER_BEFORE_AND_AFTER
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts == {"before": 0, "after": 0}  # torch has no formula of its own for the nested fast-path ops


def test_profiler_lists_the_nested_encoder_as_uncounted():
    model, x, mask = _nested_encoder()
    profiler = ModuleProfiler(model)
    profiler.start()
    with pytest.warns(UserWarning, match="nested"), torch.no_grad():
        out = model(x, src_key_padding_mask=mask)
    profiler.stop()
    profiler.remove()
    assert out.shape == (3, 5, 16)
    assert profiler.totals() == {"fwd_flops": 0, "bwd_flops": 0, "recompute_flops": 0}
    # The profiler's module hooks turn the layers' own fast path off; the nested batch then runs the layers'
    # modules one by one: per layer one attention and two feed-forward Linear layers on nested tensors.
    assert profiler.uncounted_ops() == [
        UncountedOp(op="aten._native_multi_head_attention.default", phase="fwd", calls=2),
        UncountedOp(op="aten.linear.default", phase="fwd", calls=4)]


def test_nested_fast_path_ops_are_uncounted_not_a_crash():
    """The encoder layer's own fused op, called on a nested tensor under the profiler."""
    model, x, mask = _nested_encoder()
    layer = model.layers[0]
    nested = torch._nested_tensor_from_mask(x, mask.logical_not(), mask_check=False)
    args = (nested, layer.self_attn.embed_dim, layer.self_attn.num_heads, layer.self_attn.in_proj_weight,
            layer.self_attn.in_proj_bias, layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias,
            False, False, layer.norm1.eps, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight,
            layer.norm2.bias, layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias,
            None)
    module = Call(lambda self: torch._transformer_encoder_layer_fwd(*args))
    with torch.no_grad():
        assert _profile(module) == (0, [UncountedOp(op="aten._transformer_encoder_layer_fwd.default",
                                                    phase="fwd", calls=1)])
        counter = FlopCounterMode(display=False)
        with counter:
            torch._transformer_encoder_layer_fwd(*args)
    assert counter.get_total_flops() == 0


# ---------------------------------------------------------------- linear algebra: listed, never a silent 0
def _square():
    generator = torch.Generator().manual_seed(5)
    return torch.randn(4, 4, generator=generator) + 4 * torch.eye(4)


def _spd():
    """Symmetric positive definite, made outside any profiled call (its product would be counted)."""
    return _SPD.clone()


def _rhs():
    return torch.randn(4, 2, generator=torch.Generator().manual_seed(6))


_SPD = _square() @ _square().T + torch.eye(4)
_L = torch.linalg.cholesky(_spd())
_LU, _PIVOTS = torch.linalg.lu_factor(_square())
_QR, _TAU = torch.geqrf(_square())
_SPARSE = torch.eye(3).to_sparse()

# (what is called, the aten op it reaches the counter as). The inputs (factors, sparse matrices) are made
# outside the profiled call, so each call reaches the counter as exactly one op.
LINALG_FAMILY = {
    "linalg.solve": (lambda: torch.linalg.solve(_square(), _rhs()), "aten._linalg_solve_ex.default"),
    "linalg.cholesky": (lambda: torch.linalg.cholesky(_spd()), "aten.linalg_cholesky_ex.default"),
    "cholesky": (lambda: torch.cholesky(_spd()), "aten.cholesky.default"),
    "linalg.qr": (lambda: torch.linalg.qr(_square()), "aten.linalg_qr.default"),
    "geqrf": (lambda: torch.geqrf(_square()), "aten.geqrf.default"),
    "linalg.householder_product": (lambda: torch.linalg.householder_product(_QR, _TAU),
                                   "aten.linalg_householder_product.default"),
    "ormqr": (lambda: torch.ormqr(_QR, _TAU, _rhs()), "aten.ormqr.default"),
    "linalg.svd": (lambda: torch.linalg.svd(_square()), "aten._linalg_svd.default"),
    "linalg.svdvals": (lambda: torch.linalg.svdvals(_square()), "aten._linalg_svd.default"),
    "linalg.matrix_norm(ord=2)": (lambda: torch.linalg.matrix_norm(_square(), ord=2), "aten._linalg_svd.default"),
    "linalg.eigh": (lambda: torch.linalg.eigh(_spd()), "aten._linalg_eigh.default"),
    "linalg.eigvalsh": (lambda: torch.linalg.eigvalsh(_spd()), "aten._linalg_eigh.default"),
    "linalg.eig": (lambda: torch.linalg.eig(_spd()), "aten.linalg_eig.default"),
    "linalg.eigvals": (lambda: torch.linalg.eigvals(_spd()), "aten.linalg_eig.default"),
    "linalg.lstsq": (lambda: torch.linalg.lstsq(_square(), _rhs()), "aten.linalg_lstsq.default"),
    "linalg.inv": (lambda: torch.linalg.inv(_square()), "aten.linalg_inv_ex.default"),
    "linalg.pinv": (lambda: torch.linalg.pinv(_square()), "aten.linalg_pinv.atol_rtol_tensor"),
    "linalg.det": (lambda: torch.linalg.det(_square()), "aten._linalg_det.default"),
    "linalg.slogdet": (lambda: torch.linalg.slogdet(_square()), "aten._linalg_slogdet.default"),
    "logdet": (lambda: torch.logdet(_spd()), "aten._linalg_slogdet.default"),
    "linalg.matrix_exp": (lambda: torch.linalg.matrix_exp(_square()), "aten.linalg_matrix_exp.default"),
    "linalg.lu": (lambda: torch.linalg.lu(_square()), "aten.linalg_lu.default"),
    "linalg.lu_factor": (lambda: torch.linalg.lu_factor(_square()), "aten.linalg_lu_factor_ex.default"),
    "linalg.lu_solve": (lambda: torch.linalg.lu_solve(_LU, _PIVOTS, _rhs()), "aten.linalg_lu_solve.default"),
    "linalg.ldl_factor": (lambda: torch.linalg.ldl_factor(_spd()), "aten.linalg_ldl_factor_ex.default"),
    "linalg.solve_triangular": (lambda: torch.linalg.solve_triangular(_L, _rhs(), upper=False),
                                "aten.linalg_solve_triangular.default"),
    "triangular_solve": (lambda: torch.triangular_solve(_rhs(), _L, upper=False), "aten.triangular_solve.default"),
    "cholesky_solve": (lambda: torch.cholesky_solve(_rhs(), _L), "aten.cholesky_solve.default"),
    "cholesky_inverse": (lambda: torch.cholesky_inverse(_L), "aten.cholesky_inverse.default"),
    "cdist": (lambda: torch.cdist(_square(), _rhs().T), "aten._cdist_forward.default"),
    "cdist (matmul path, > 25 rows)": (lambda: torch.cdist(torch.ones(30, 4), torch.ones(26, 4)),
                                       "aten._euclidean_dist.default"),
    "pdist": (lambda: torch.pdist(_square()), "aten._pdist_forward.default"),
    "sspaddmm": (lambda: torch.sspaddmm(_SPARSE, _SPARSE, torch.ones(3, 3)), "aten.sspaddmm.out"),
    "smm": (lambda: torch.smm(_SPARSE, torch.ones(3, 3)), "aten.sspaddmm.out"),
    "hspmm": (lambda: torch.hspmm(_SPARSE, torch.ones(3, 3)), "aten.hspmm.default"),
    "sparse.mm": (lambda: torch.sparse.mm(_SPARSE, torch.ones(3, 3)), "aten._sparse_addmm.default"),
}


@pytest.mark.parametrize("name", sorted(LINALG_FAMILY))
def test_linear_algebra_without_a_formula_is_listed_by_name(name):
    fn, op = LINALG_FAMILY[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.cholesky and torch.triangular_solve are deprecated
        assert _profile(Call(lambda self: fn())) == (0, [UncountedOp(op=op, phase="fwd", calls=1)])


def test_linear_algebra_backward_is_listed_in_its_phase():
    """linalg.solve's backward solves with the saved LU factors (aten.linalg_lu_solve, listed) and forms the
    matrix gradient -gB X^T as a (4, 2) @ (2, 4) mm (counted: 2 * 4 * 2 * 4 = 64)."""
    a = _square().requires_grad_()
    module = Call(lambda self, m, b: torch.linalg.solve(m, b).sum())
    assert _profile_fwd_bwd(module, a, _rhs()) == (0, 64, [
        UncountedOp(op="aten._linalg_solve_ex.default", phase="fwd", calls=1),
        UncountedOp(op="aten.linalg_lu_solve.default", phase="bwd", calls=1)])


@pytest.mark.parametrize("name, fn, flops", [
    ("tensordot", lambda a, b: torch.tensordot(a, b, dims=1), 2 * 4 * 4 * 2),
    ("einsum", lambda a, b: torch.einsum("ij,jk->ik", a, b), 2 * 4 * 4 * 2),
    ("linalg.matrix_power", lambda a, b: torch.linalg.matrix_power(a, 3), 2 * (2 * 4 * 4 * 4)),
    # multi_dot picks a (b c) here: 4x4 @ 4x2 twice
    ("linalg.multi_dot", lambda a, b: torch.linalg.multi_dot([a, a, b]), 2 * (2 * 4 * 4 * 2)),
    ("chain_matmul", lambda a, b: torch.linalg.multi_dot([a, b]), 2 * 4 * 4 * 2),
])
def test_linear_algebra_that_decomposes_into_gemms_is_counted(name, fn, flops):
    assert _profile(Call(lambda self, a, b: fn(a, b)), _square(), _rhs()) == (flops, [])


# ---------------------------------------------------------------- other_flops: RMSNorm and rotary embeddings
def _other_flops(module, x):
    profiler = ModuleProfiler(module)
    profiler.start()
    module(x).sum().backward()
    profiler.stop()
    profiler.remove()
    tree = profiler.tree()
    return tree["fwd_flops"], tree["bwd_flops"], tree["fwd_other_flops"], tree["bwd_other_flops"]


@pytest.mark.parametrize("make, per_element", [
    (lambda: MegatronRMSNorm(16), 4),  # square, mean, normalise, weight
    (lambda: torch.nn.RMSNorm(16), 4),
    (lambda: torch.nn.RMSNorm(16, elementwise_affine=False), 3),
])
def test_rms_norm_counts_other_flops(make, per_element):
    x = torch.randn(2, 8, 16, requires_grad=True)  # 256 elements
    assert _other_flops(make(), x) == (0, 0, per_element * 256, 2 * per_element * 256)


@pytest.mark.parametrize("rotary_dim, rotated", [(8, 2 * 2 * 8 * 8), (4, 2 * 2 * 8 * 4)])
def test_rotary_embedding_counts_other_flops(rotary_dim, rotated):
    """[batch 2, heads 2, seq 8, head_dim 8]: 3 FLOPs per rotated element, forward and backward alike."""
    x = torch.randn(2, 2, 8, 8, requires_grad=True)
    assert _other_flops(RotaryEmbedding(rotary_dim), x) == (0, 0, 3 * rotated, 3 * rotated)


def test_vdot_backward_follows_the_gemm_rule():
    """vdot of length 9 (real): forward 18, backward its two scalar-vector gradients, 18 each."""
    a, b = _mv_dot_inputs()[2:]
    assert _profile_fwd_bwd(Call(lambda self, x, y: torch.vdot(x, y)), a, b) == (18, 36, [])
