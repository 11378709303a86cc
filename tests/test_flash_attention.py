"""flash-attn's kernels counted like SDPA, and attention torch cannot see named, never a silent 0.

flash-attn 2.6 and later reach torch as custom ops, flashattn::_flash_attn_forward and friends (flash_attn::
in 2.6). This machine has no flash-attn, so the test registers ops of the same names and argument lists with
CPU bodies (SDPA's math), called the way flash-attn's autograd functions call them; the profile of an
attention module through them must equal the profile of the same attention through
F.scaled_dot_product_attention on the same shapes, forward and backward, padded and packed (varlen)."""
import torch
import torch.nn.functional as F
from torch.library import custom_op

from patches.profiler.files import validate_report
from patches.profiler.module_profiler import ModuleProfiler
from patches.profiler.printer import format_report
from patches.profiler.report import build_report
from tests.helpers.contexts import report_context

BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8


def _sdpa(q, k, v, causal):
    """q (b, s, h, d), k and v (b, s, kv heads, d): SDPA on torch's layout, every query head over its kv head."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def _sdpa_grads(q, k, v, dout, causal):
    """dq, dk, dv of _sdpa, by hand (a custom op's body runs below autograd): dV = P^T dO, dP = dO V^T,
    dS = P (dP - rowsum(dO O)), dQ = dS K scale, dK = dS^T Q scale; a kv head's gradients summed over its
    query heads."""
    groups = q.shape[2] // k.shape[2]
    q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    p = scores.softmax(-1)
    out = p @ v
    dv = p.transpose(-1, -2) @ dout
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    dq, dk = ds @ k * scale, ds.transpose(-1, -2) @ q * scale
    dk, dv = (t.unflatten(1, (-1, groups)).sum(2) for t in (dk, dv))
    return (t.transpose(1, 2) for t in (dq, dk, dv))


# The argument lists of flash-attn's own ops (flash_attn/flash_attn_interface.py), bodies of our own.
@custom_op("flashattn::_flash_attn_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
             causal: bool, window_size_left: int, window_size_right: int, softcap: float,
             alibi_slopes: torch.Tensor | None, return_softmax: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out = _sdpa(q, k, v, causal)
    return out, torch.zeros(q.shape[0], q.shape[2], q.shape[1]), torch.empty(0), torch.zeros(2, dtype=torch.int64)


@custom_op("flashattn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dropout_p: float,
              softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int, softcap: float,
              alibi_slopes: torch.Tensor | None, deterministic: bool, rng_state: torch.Tensor | None = None
              ) -> torch.Tensor:
    for buffer, grad in zip((dq, dk, dv), _sdpa_grads(q, k, v, dout, causal)):
        buffer.copy_(grad)
    return torch.zeros(q.shape[0], q.shape[2], q.shape[1])


@custom_op("flashattn::_flash_attn_varlen_forward", mutates_args=())
def _varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                    softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
                    block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
                    seqused_k: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    bounds = cu_seqlens_q.tolist()
    out = torch.cat([_sdpa(q[None, a:b], k[None, a:b], v[None, a:b], causal)[0] for a, b in zip(bounds, bounds[1:])])
    return out, torch.zeros(q.shape[1], q.shape[0]), torch.empty(0), torch.zeros(2, dtype=torch.int64)


@custom_op("flashattn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
                     window_size_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
                     deterministic: bool, rng_state: torch.Tensor | None = None) -> torch.Tensor:
    bounds = cu_seqlens_q.tolist()
    for a, b in zip(bounds, bounds[1:]):
        grads = _sdpa_grads(q[None, a:b], k[None, a:b], v[None, a:b], dout[None, a:b], causal)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer[a:b].copy_(grad[0])
    return torch.zeros(q.shape[1], q.shape[0])


class _FlashAttnFunc(torch.autograd.Function):
    """How flash-attn's FlashAttnFunc drives its ops: forward, then backward into preallocated dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        out, lse, _, rng = torch.ops.flashattn._flash_attn_forward(q, k, v, 0.0, HEAD_DIM ** -0.5, causal, -1, -1,
                                                                   0.0, None, False)
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flashattn._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, HEAD_DIM ** -0.5,
                                                 ctx.causal, -1, -1, 0.0, None, False, rng_state=rng)
        return dq, dk, dv, None


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen):
        out, lse, _, rng = torch.ops.flashattn._flash_attn_varlen_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, HEAD_DIM ** -0.5, True)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng)
        ctx.max_seqlen = max_seqlen
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens, rng = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flashattn._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens, cu_seqlens, ctx.max_seqlen, ctx.max_seqlen, 0.0,
            HEAD_DIM ** -0.5, True, -1, -1, 0.0, None, False, rng_state=rng)
        return dq, dk, dv, None, None


class Attention(torch.nn.Module):
    """The core attention of a layer: by `kernel`, SDPA, flash-attn's ops, or one torch cannot see."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def forward(self, q, k, v, cu_seqlens=None):
        if self.kernel == "flash":
            return _FlashAttnFunc.apply(q, k, v, True)
        if self.kernel == "flash_varlen":
            return _FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens, max((cu_seqlens[1:] - cu_seqlens[:-1]).tolist()))
        if self.kernel == "sdpa_varlen":  # each packed sequence on its own
            bounds = cu_seqlens.tolist()
            return torch.cat([_sdpa(q[None, a:b], k[None, a:b], v[None, a:b], True)[0]
                              for a, b in zip(bounds, bounds[1:])])
        if self.kernel == "invisible":  # an extension's kernel: torch sees no op of it
            with torch._C._DisableTorchDispatch():
                return _sdpa(q, k, v, True).detach().requires_grad_()
        return _sdpa(q, k, v, True)


class FlashSelfAttention(Attention):
    """Named as upstream Megatron-DeepSpeed names its flash-attention module."""


def profile(kernel, *shape, cu_seqlens=None, module_type=Attention, ignore_types=()):
    """(fwd flops, bwd flops, uncounted ops, the profiler) of one forward and backward through `kernel`."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(*shape, HEADS, HEAD_DIM, generator=generator, requires_grad=True)
    k, v = (torch.randn(*shape, KV_HEADS, HEAD_DIM, generator=generator, requires_grad=True) for _ in range(2))
    module = module_type(kernel)
    profiler = ModuleProfiler(module, ignore_types=ignore_types)
    profiler.start()
    module(q, k, v, cu_seqlens).sum().backward()
    profiler.stop()
    profiler.remove()
    tree = profiler.tree()
    return tree["fwd_flops"], tree["bwd_flops"], profiler.uncounted_ops(), profiler


def test_flash_attn_ops_count_as_sdpa_on_the_same_shapes():
    fwd, bwd, uncounted, _ = profile("flash", BATCH, 16)
    assert (fwd, bwd, uncounted) == profile("sdpa", BATCH, 16)[:3]
    # dense attention, every query head: QK^T and PV forward, 5 GEMMs of a flash backward
    assert fwd == 2 * BATCH * HEADS * 16 * 16 * (HEAD_DIM + HEAD_DIM)
    assert bwd == 2 * BATCH * HEADS * 16 * 16 * (3 * HEAD_DIM + 2 * HEAD_DIM) and uncounted == []


def test_flash_attn_varlen_ops_count_each_packed_sequence():
    cu_seqlens = torch.tensor([0, 5, 16, 24], dtype=torch.int32)  # sequences of 5, 11 and 8 tokens
    fwd, bwd, uncounted, _ = profile("flash_varlen", 24, cu_seqlens=cu_seqlens)
    assert (fwd, bwd, uncounted) == profile("sdpa_varlen", 24, cu_seqlens=cu_seqlens)[:3]
    assert fwd == sum(2 * HEADS * n * n * 2 * HEAD_DIM for n in (5, 11, 8))


def test_attention_torch_cannot_see_is_named_never_a_silent_zero():
    fwd, bwd, uncounted, profiler = profile("invisible", BATCH, 16, module_type=FlashSelfAttention)
    assert (fwd, bwd, uncounted) == (0, 0, [])
    entry = {"global_rank": 0, "stage_id": 0, "tp_rank": 0, "dp_rank": 0, "modules": profiler.tree(),
             "instructions": {}, "train_batch_latency_s": 0.01, "peak_memory_bytes": None,
             "invisible_attention": profiler.invisible_attention()}
    analytic = {"fwd_flops": 100, "bwd_flops": 200, "recompute_flops": 0}
    report = build_report([entry], report_context(1, 1, 1, 1, 1, BATCH, analytic=analytic))
    validate_report(report)
    assert report["invisible_attention"] == [{"module": "FlashSelfAttention", "type": "FlashSelfAttention",
                                              "calls": 1}]
    text = format_report(report)
    assert "attention not counted:" in text and "FlashSelfAttention (FlashSelfAttention) x1: a kernel torch " \
                                               "cannot see" in text
    assert "measured / analytic:" in text and "(short: the attention of 1 module(s) is not counted)" in text
    # the same module through a kernel torch sees is not named
    assert profile("flash", BATCH, 16, module_type=FlashSelfAttention)[3].invisible_attention() == []


class Wrapper(torch.nn.Module):
    """An attention module all of whose work is its child's."""

    def __init__(self, kernel):
        super().__init__()
        self.inner = Attention(kernel)

    def forward(self, q, k, v, cu_seqlens=None):
        return self.inner(q, k, v, cu_seqlens)


class WrappingAttention(Wrapper):
    pass


def test_attention_left_out_by_ignore_list_is_not_named():
    """DeepSpeed's ignore_list leaves a module's work out of the tree: its parent's zero is not an invisible kernel."""
    assert profile("sdpa", BATCH, 16, module_type=WrappingAttention, ignore_types=[Attention])[3] \
        .invisible_attention() == []
    # the deepest attention module without counted work is the one named, not its parent too
    assert profile("invisible", BATCH, 16, module_type=WrappingAttention)[3].invisible_attention() == [
        {"module": "inner", "type": "Attention", "calls": 1}]


def test_varlen_flops_depend_on_values_so_a_counting_pass_cannot_vouch_for_them():
    """The same shapes with other sequence boundaries run other FLOPs: a profiled iteration never takes them from
    the iteration before (adopt_counts names them, so the schedule counts the next iteration in itself)."""
    cu_seqlens = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    _, _, _, counted = profile("flash_varlen", 24, cu_seqlens=cu_seqlens)
    module = counted.root_module
    timed = ModuleProfiler(module, count_flops=False)
    timed.start()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(24, HEADS, HEAD_DIM, generator=generator, requires_grad=True)
    k, v = (torch.randn(24, KV_HEADS, HEAD_DIM, generator=generator, requires_grad=True) for _ in range(2))
    module(q, k, v, cu_seqlens).sum().backward()
    timed.stop()
    timed.remove()
    differ = timed.adopt_counts(counted)
    assert differ == [f"Attention: {phase} FLOPs of flashattn._flash_attn_varlen_{kind}.default depend on tensor "
                      "values, not shapes alone" for phase, kind in (("bwd", "backward"), ("fwd", "forward"))]


def test_the_stand_in_ops_compute_what_sdpa_computes():
    """The ops above are faithful stand-ins: the same outputs and gradients as SDPA (so the two profiles above
    are of the same computation)."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(BATCH, 16, HEADS, HEAD_DIM, generator=generator, requires_grad=True)
    k, v = (torch.randn(BATCH, 16, KV_HEADS, HEAD_DIM, generator=generator, requires_grad=True) for _ in range(2))
    results = []
    for kernel in ("flash", "sdpa"):
        out = Attention(kernel)(q, k, v)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs)
