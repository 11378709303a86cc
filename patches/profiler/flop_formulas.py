"""FLOP formulas the profiler needs beyond `torch.utils.flop_counter`'s registry.

aten formulas, added to torch's own registry through its public `register_flop_formula`, for the
CPU scaled-dot-product-attention kernels torch does not cover and the GEMM-class ops it lacks. Importing this
module registers them once (it skips any op torch already knows, so a newer torch keeps its own formula).
flash-attn's custom ops are looked up by name (custom_op_formula), and `is_matrix_class` says which ops without a
formula are reported as uncounted. (Modules whose kernels never reach the aten dispatcher have formulas of
their own: module_flops.py.)

Conventions (docs/profiling.md): 2 FLOPs per multiply-accumulate, attention counted dense
(no causal discount), matrix-class work only in fwd/bwd/recompute_flops.

Which op `F.scaled_dot_product_attention` reaches on CPU (torch 2.13, checked for float32 and bfloat16,
with and without `is_causal`):
- dropout_p == 0: `aten._scaled_dot_product_flash_attention_for_cpu` and, in backward,
  `aten._scaled_dot_product_flash_attention_for_cpu_backward`. Counted by the formulas below.
- dropout_p > 0: the math fallback, which decomposes into `aten.bmm` (Q K^T, P V forward; dV, dP, dQ,
  dK backward: 4 bmm = 2x forward). torch's bmm formula counts those.
On CUDA the flash / memory-efficient / cuDNN ops are in torch's registry already.
"""
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch.utils import flop_counter

aten = torch.ops.aten

Shape = Sequence[int]  # a tensor's shape, as torch's flop registry passes it


def _attention_shapes(query_shape, key_shape, value_shape):
    batch, heads, q_len, head_dim = query_shape
    k_len, v_dim = key_shape[-2], value_shape[-1]
    # Grouped-query attention: every query head attends over its (shared) key/value head.
    return batch * heads, q_len, k_len, head_dim, v_dim


def attention_forward_flops(query_shape: Shape, key_shape: Shape, value_shape: Shape) -> int:
    """Dense attention forward: S = Q K^T and O = P V, 2 GEMMs."""
    bh, q_len, k_len, head_dim, v_dim = _attention_shapes(query_shape, key_shape, value_shape)
    return 2 * bh * q_len * k_len * (head_dim + v_dim)


def flash_attention_backward_flops(query_shape: Shape, key_shape: Shape,
                                   value_shape: Shape) -> int:
    """What a flash-style attention backward executes: 5 GEMMs, 2.5x the forward when v_dim == head_dim.

    PyTorch's CPU kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp,
    `cpu_flash_attention_backward`) runs, per (query block, key block):
        P  = exp(scale * Q K^T - logsumexp)   (recomputes the scores: a head_dim GEMM)
        dV += P^T dO                          (v_dim)
        dP  = dO V^T                          (v_dim)
        dQ += scale * dS K                    (head_dim)
        dK += scale * dS^T Q                  (head_dim)
    torch's CUDA formula (`sdpa_backward_flop_count`, used for the flash, memory-efficient and cuDNN
    backward ops) counts the same 5 GEMMs. Like the forward, the count is dense: the CPU kernel does
    skip key blocks entirely above the causal diagonal, but the convention has no causal discount.
    """
    bh, q_len, k_len, head_dim, v_dim = _attention_shapes(query_shape, key_shape, value_shape)
    return 2 * bh * q_len * k_len * (3 * head_dim + 2 * v_dim)


def _register_cpu_attention_formulas():
    # register_flop_formula wraps each formula so it receives shapes; out_shape is the op's output.
    if aten._scaled_dot_product_flash_attention_for_cpu not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
        def _cpu_flash_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
            return attention_forward_flops(query_shape, key_shape, value_shape)

    if aten._scaled_dot_product_flash_attention_for_cpu_backward not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
        def _cpu_flash_attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args,
                                          out_shape=None, **kwargs):
            return flash_attention_backward_flops(query_shape, key_shape, value_shape)


_register_cpu_attention_formulas()


# ---------------------------------------------------------------- GEMM-class ops torch's registry lacks
def matrix_vector_flops(mat_shape: Shape) -> int:
    """mv / addmv: an (n, m) matrix times an m-vector, 2 flops per multiply-accumulate (the add is not matrix work)."""
    rows, cols = mat_shape
    return 2 * rows * cols


def addbmm_flops(batch1_shape: Shape, batch2_shape: Shape) -> int:
    """addbmm: the b products (n, m) @ (m, p) summed into one (n, p): 2 * b * n * m * p."""
    batches, n, m = batch1_shape
    return 2 * batches * n * m * batch2_shape[-1]


def grouped_mm_flops(self_shape: Shape, mat2_shape: Shape, out_shape: Shape) -> int:
    """_grouped_mm: per group a GEMM. With a 3-d operand (groups stacked, or offsets slicing the 2-d one
    along M or N) every output element contracts over self's last dim; 2-d x 2-d slices K by the offsets
    into a (groups, M, N) output, so the contractions add up to M * K_total * N."""
    if len(self_shape) == 2 and len(mat2_shape) == 2:
        return 2 * self_shape[0] * self_shape[1] * mat2_shape[1]
    out_elements = 1
    for size in out_shape:
        out_elements *= size
    return 2 * out_elements * self_shape[-1]


def dot_flops(a_shape: Shape) -> int:
    return 2 * a_shape[0]


def _register_gemm_class_formulas():
    formulas = {
        aten.mv: lambda mat_shape, vec_shape, *args, out_shape=None, **kwargs: matrix_vector_flops(mat_shape),
        aten.addmv: lambda self_shape, mat_shape, vec_shape, *args, out_shape=None, **kwargs:
            matrix_vector_flops(mat_shape),
        aten.addbmm: lambda self_shape, batch1_shape, batch2_shape, *args, out_shape=None, **kwargs:
            addbmm_flops(batch1_shape, batch2_shape),
        aten._grouped_mm: lambda self_shape, mat2_shape, *args, out_shape=None, **kwargs:
            grouped_mm_flops(self_shape, mat2_shape, out_shape),
        aten.dot: lambda a_shape, b_shape, *args, out_shape=None, **kwargs: dot_flops(a_shape),
        aten.vdot: lambda a_shape, b_shape, *args, out_shape=None, **kwargs: dot_flops(a_shape),
    }
    for packet, formula in formulas.items():
        if packet not in flop_counter.flop_registry:  # a newer torch keeps its own
            flop_counter.register_flop_formula(packet)(formula)


_register_gemm_class_formulas()


# The backward of mv / addmv / dot / vdot (tools/autograd/derivatives.yaml) forms a product that is not a
# GEMM op: mv's matrix gradient is `grad.ger(vec)`, which runs as aten.mul.Tensor of a (n, 1) view and the
# m-vector; dot's two gradients are aten.mul.Tensor of the 0-d grad and the other vector. Each is a GEMM
# with a contraction of 1 (the same numbers as torch's mm formula on (n, 1) @ (1, m)): 2 FLOPs per output
# element. The vector gradient of mv is an aten.mv, counted by its own formula. Scalings by alpha
# (aten.mul.Scalar) are not matrix work, as in the forward formulas.
GEMM_BACKWARD_NODES = frozenset(("MvBackward0", "AddmvBackward0", "DotBackward0", "VdotBackward0"))


def gemm_backward_product_flops(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """For aten.mul.Tensor: 2 * output elements when it runs inside one of GEMM_BACKWARD_NODES (an outer or
    scalar-vector product standing for a GEMM gradient), else 0 (plain element-wise work)."""
    node = torch._C._current_autograd_node()
    if node is None or node.name() not in GEMM_BACKWARD_NODES or not isinstance(out_val, torch.Tensor):
        return 0
    return 2 * out_val.numel()


# ---------------------------------------------------------------- inference fast paths
# Under no_grad / inference_mode, nn.MultiheadAttention and nn.TransformerEncoderLayer call fused kernels
# instead of the linear / attention ops they run with autograd on. The formulas count the same GEMMs, so
# a profile does not depend on the grad mode.
def multi_head_attention_flops(query_shape: Shape, key_shape: Shape, embed_dim: int) -> int:
    """Batch-first (B, L, E) query, (B, S, E) key/value: the q, k, v projections, Q K^T and P V over all
    heads together (the head dims add up to E), and the output projection."""
    batch, q_len = query_shape[0], query_shape[1]
    kv_len = key_shape[1]
    projections = 2 * embed_dim * embed_dim * (batch * q_len + 2 * batch * kv_len)
    attention = 4 * batch * q_len * kv_len * embed_dim
    output = 2 * batch * q_len * embed_dim * embed_dim
    return projections + attention + output


def any_nested(values: Iterable[Any]) -> bool:
    """Whether any of `values` is a nested tensor (no sizes for a formula to read)."""
    return any(isinstance(value, torch.Tensor) and value.is_nested for value in values)


def _register_fast_path_formulas():
    # Registered raw (get_raw=True): torch's shape wrapper reads `.shape` of every tensor argument, which a
    # nested tensor (TransformerEncoder's padding-mask fast path) does not have. A nested call counts 0
    # here, what torch's own FlopCounterMode counted for these ops before this module registered them; the
    # ModuleProfiler lists it as uncounted instead (module_profiler.py).
    if aten._native_multi_head_attention not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(aten._native_multi_head_attention, get_raw=True)
        def _native_mha(query, key, value, embed_dim, *args, out_val=None, **kwargs):
            if any_nested((query, key, value)):
                return 0
            return multi_head_attention_flops(query.shape, key.shape, embed_dim)

    if aten._transformer_encoder_layer_fwd not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(aten._transformer_encoder_layer_fwd, get_raw=True)
        def _encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                           norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1,
                           *args, out_val=None, **kwargs):
            if src.is_nested:
                return 0
            batch, length = src.shape[0], src.shape[1]
            ffn = 2 * 2 * batch * length * embed_dim * ffn_weight_1.shape[0]  # two Linear layers
            return multi_head_attention_flops(src.shape, src.shape, embed_dim) + ffn


_register_fast_path_formulas()


# ---------------------------------------------------------------- flash-attn's custom ops
# flash-attn 2.6 and later reach torch as custom ops (torch.library.custom_op) named flash_attn::... (2.6) or
# flashattn::... (later releases), which exist only once flash_attn is imported and which torch's registry
# does not know. Their formulas are looked up by name (custom_op_formula), so nothing is registered with
# torch for them. Conventions as torch's SDPA formulas: dense (no causal or sliding-window discount), every
# query head over its key/value head (grouped-query attention), the forward 2 GEMMs (Q K^T, P V), the
# backward the 5 GEMMs of a flash backward (flash_attention_backward_flops, as torch's sdpa_backward_flop_count).
# Shapes are those the kernel receives (flash-attn pads head_dim to a multiple of 8 before calling it).
FLASH_ATTN_NAMESPACES = frozenset(("flash_attn", "flashattn"))


def _flash_layout(q_shape, k_shape, v_shape):
    """flash-attn's (batch, seq, heads, head_dim) as torch SDPA's (batch, heads, seq, head_dim)."""
    return ((q_shape[0], q_shape[2], q_shape[1], q_shape[3]), (k_shape[0], k_shape[2], k_shape[1], k_shape[3]),
            (v_shape[0], v_shape[2], v_shape[1], v_shape[3]))


def flash_attn_forward_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, out_val: Any = None,
                             **kwargs: Any) -> int:
    """_flash_attn_forward(q, k, v, ...): q (batch, seq_q, heads, head_dim), k and v (batch, seq_k, kv heads, .)."""
    return attention_forward_flops(*_flash_layout(q.shape, k.shape, v.shape))


def flash_attn_backward_flops(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                              out_val: Any = None, **kwargs: Any) -> int:
    """_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, ...)."""
    return flash_attention_backward_flops(*_flash_layout(q.shape, k.shape, v.shape))


def _varlen_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, per_pair):
    """Sum over the packed sequences (lengths from the cumulative offsets) of per_pair(one sequence's shapes)."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, v_dim = k.shape[1], v.shape[2]
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    return sum(per_pair((1, heads, q_len, head_dim), (1, kv_heads, k_len, head_dim), (1, kv_heads, k_len, v_dim))
               for q_len, k_len in zip(lengths_q, lengths_k))


def flash_attn_varlen_forward_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, *args: Any, out_val: Any = None,
                                    **kwargs: Any) -> int:
    """_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, ...): q (total_q, heads, head_dim)."""
    return _varlen_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, attention_forward_flops)


def flash_attn_varlen_backward_flops(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     out: torch.Tensor, softmax_lse: torch.Tensor, dq: Any, dk: Any, dv: Any,
                                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *args: Any,
                                     out_val: Any = None, **kwargs: Any) -> int:
    """_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, ...)."""
    return _varlen_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, flash_attention_backward_flops)


# Formulas that read tensor values, not shapes alone: two iterations with the same shapes may differ in FLOPs
# (the module profiler says so where it compares a counting pass with a profiled one).
VALUE_DEPENDENT_FORMULAS = frozenset((flash_attn_varlen_forward_flops, flash_attn_varlen_backward_flops))

_CUSTOM_OP_FORMULAS = {
    "_flash_attn_forward": flash_attn_forward_flops,
    "_flash_attn_backward": flash_attn_backward_flops,
    "_flash_attn_varlen_forward": flash_attn_varlen_forward_flops,
    "_flash_attn_varlen_backward": flash_attn_varlen_backward_flops,
}


def custom_op_formula(func: Any) -> Optional[Callable[..., int]]:
    """The formula of a custom op known by name (flash-attn's), called on the op's own arguments; else None."""
    if getattr(func, "namespace", None) not in FLASH_ATTN_NAMESPACES:
        return None
    return _CUSTOM_OP_FORMULAS.get(func._overloadpacket.__name__)


# Name tokens of aten ops that do matrix-class work (GEMM, convolution, attention, recurrent cells, dense
# linear algebra and distance matrices; not norms such as linalg_vector_norm). An op with one of them and
# no formula is reported as uncounted, never silently 0.
_MATRIX_TOKENS = frozenset((
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "matmul", "addr", "linear",
    "einsum", "tensordot", "gemm", "gemv", "attention", "attn", "transformer", "lstm", "gru", "rnn",
    "convolution",
    # linear algebra: the ops torch.linalg and its older torch.* spellings reach the dispatcher as
    # (_linalg_solve_ex, linalg_lu_solve, linalg_solve_triangular, triangular_solve, cholesky_solve,
    # linalg_cholesky_ex, cholesky, cholesky_inverse, linalg_qr, geqrf, ormqr, linalg_householder_product,
    # _linalg_svd, _linalg_eigh, linalg_eig, linalg_lstsq, linalg_inv_ex, _linalg_det, _linalg_slogdet,
    # linalg_lu, linalg_lu_factor_ex, linalg_ldl_factor_ex, linalg_ldl_solve, linalg_pinv)
    "solve", "cholesky", "qr", "geqrf", "orgqr", "ormqr", "householder", "svd", "eigh", "eig", "lstsq", "inv",
    "inverse", "det", "slogdet", "lu", "ldl", "pinv",
    # distance matrices and sparse products (_cdist_forward, _euclidean_dist, _pdist_forward, sspaddmm, ...)
    "cdist", "pdist", "euclidean", "sspaddmm", "hspmm", "smm", "spmm"))
# Whole names: a matrix op whose tokens are too common alone, and ops with a matrix token but no
# floating-point matrix work (lu_unpack builds the permutation and copies the triangles).
_MATRIX_NAMES = frozenset(("linalg_matrix_exp", "matrix_exp"))
_NOT_MATRIX_NAMES = frozenset(("lu_unpack",))


def is_matrix_class(op_name: str) -> bool:
    """op_name: an aten packet's name, e.g. '_weight_int8pack_mm' or 'mkldnn_convolution'."""
    name = op_name.strip("_")
    if op_name.startswith("upsample") or name in _NOT_MATRIX_NAMES:  # upsample_*: interpolation, no GEMM
        return False
    if name in _MATRIX_NAMES:
        return True
    for token in name.split("_"):
        if token in _MATRIX_TOKENS or (token.startswith("conv") and not token.startswith("convert")):
            return True
    return False
