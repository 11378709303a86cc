"""A tiny LLaMA-shaped GPT (the tiny GPT's sizes, flags.TINY_GPT, with every LLaMA switch) and the exact
numbers its profile report must hold, from its shape alone.

Grouped-query attention (4 query heads over 2 key/value heads, head size 8), SwiGLU with inner size
FFN, RMSNorm, rotary position embeddings, an untied LM head, no linear biases.

FLOPs: forward L (2Bsh(h + 2 g d) + 4Bs^2 h + 2Bsh^2 + 6Bsh f) + 2BshV; backward 2x every GEMM and
5/2 x the attention core (see tiny_gpt); recompute: the layers' forward (full) or the attention core
alone (selective). Norms, rotary embeddings and the SwiGLU product are elementwise: not counted.
"""
from patches.profiler.files import validate_report
from tests.helpers.flags import TINY_GPT
from tests.helpers.tiny_gpt import HIDDEN, SEQ, VOCAB

_FLAGS = dict(zip(TINY_GPT[::2], TINY_GPT[1::2]))
LAYERS = int(_FLAGS["--num-layers"])
HEADS = int(_FLAGS["--num-attention-heads"])
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 48  # a multiple of tp 2
LLAMA_FLAGS = [
    "--num-key-value-heads", str(KV_HEADS), "--swiglu", "--ffn-hidden-size", str(FFN),
    "--normalization", "rmsnorm", "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--no-query-key-layer-scaling",
]
TINY_LLAMA = TINY_GPT + LLAMA_FLAGS


def layer_params():
    h, d = HIDDEN, HEAD_DIM
    qkv = h * (HEADS * d + 2 * KV_HEADS * d)
    dense = HEADS * d * h
    mlp = h * 2 * FFN + FFN * h
    return qkv + dense + mlp + 2 * h  # two RMSNorm weights


def dense_params(layers=LAYERS):
    """Word embedding, layers, final RMSNorm, untied LM head (no position table: rotary)."""
    return VOCAB * HIDDEN + layers * layer_params() + HIDDEN + VOCAB * HIDDEN


def attention_core_fwd(layers, sequences):
    return layers * 4 * sequences * SEQ * SEQ * HIDDEN


def expected_flops(layers, sequences):
    """(fwd, bwd, layers' fwd, attention core fwd) of one replica's iteration over `sequences` sequences."""
    b, s, h, d, g, f = sequences, SEQ, HIDDEN, HEAD_DIM, KV_HEADS, FFN
    core = attention_core_fwd(layers, sequences)
    layer_fwd = layers * (2 * b * s * h * (h + 2 * g * d) + 2 * b * s * h * h + 6 * b * s * h * f) + core
    fwd = layer_fwd + 2 * b * s * h * VOCAB
    bwd = 2 * (fwd - core) + core * 5 // 2
    return fwd, bwd, layer_fwd, core


def check_totals(report, sequences, recompute, recomputed_layers=LAYERS):
    """recompute: None, 'full' (of recomputed_layers layers) or 'selective'. Totals equal the dense
    model's params and FLOPs exactly."""
    validate_report(report)
    fwd, bwd, layer_fwd, core = expected_flops(LAYERS, sequences)
    totals = report["totals"]
    assert totals["params"] == dense_params()
    assert (totals["fwd_flops"], totals["bwd_flops"]) == (fwd, bwd)
    full = layer_fwd * recomputed_layers // LAYERS
    assert totals["recompute_flops"] == {None: 0, "full": full, "selective": core}[recompute]
