"""The exact numbers a profile report of the tiny GPT (flags.TINY_GPT) must hold, from its shape alone.

FLOPs: forward by the Megatron-LM formula (2 per multiply-accumulate, attention dense); backward 2x
every GEMM, and 5 attention GEMMs where the forward has 2 (the CPU flash kernel recomputes Q K^T,
then dV, dP, dQ, dK); recompute = the transformer layers' forward.
"""
from patches.profiler.files import validate_report
from tests.helpers.flags import TINY_GPT

_FLAGS = dict(zip(TINY_GPT[::2], TINY_GPT[1::2]))
HIDDEN = int(_FLAGS["--hidden-size"])
SEQ = int(_FLAGS["--seq-length"])
VOCAB = 192  # the synthetic vocabulary, a multiple of 8 x tp for tp 1 and 2: no padding
FFN = 4 * HIDDEN
LAYER_TYPE = "ParallelTransformerLayerPipe"


def layer_params():
    h, f = HIDDEN, FFN
    return (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h


def embedding_params():
    return VOCAB * HIDDEN + SEQ * HIDDEN


def dense_params(layers):
    """The whole model, the tied embedding once."""
    return embedding_params() + layers * layer_params() + 2 * HIDDEN


def expected_flops(layers, sequences):
    """(fwd, bwd, recompute-if-checkpointed) of one replica's iteration over `sequences` sequences."""
    h, s = HIDDEN, SEQ
    attention_fwd = layers * 4 * sequences * s * s * h
    layer_fwd = layers * 24 * sequences * s * h * h + attention_fwd
    fwd = layer_fwd + 2 * sequences * s * h * VOCAB
    bwd = 2 * (fwd - attention_fwd) + attention_fwd * 5 // 2
    return fwd, bwd, layer_fwd


def check_totals(report, layers, sequences, checkpointing):
    """Schema, and totals equal to the dense model's params and the analytic FLOPs, exactly."""
    validate_report(report)
    fwd, bwd, layer_fwd = expected_flops(layers, sequences)
    totals = report["totals"]
    assert totals["params"] == dense_params(layers)
    assert (totals["fwd_flops"], totals["bwd_flops"]) == (fwd, bwd)
    assert totals["recompute_flops"] == (layer_fwd if checkpointing else 0)
    assert report["activation_checkpointing"] is checkpointing


def stage_layers(report):
    """Per stage, the global spec indices of its transformer layers (spec 0 is the embedding)."""
    return [sorted(int(child["name"]) for child in stage["modules"]["children"] if child["type"] == LAYER_TYPE)
            for stage in report["stages"]]


def check_stage_params(report, layers_per_stage, norm_stage=-1):
    """Each stage holds its layers; the first and last also the tied embedding; norm_stage the final norm."""
    last = len(layers_per_stage) - 1
    norm_stage = norm_stage % len(layers_per_stage)
    assert [stage["stage_id"] for stage in report["stages"]] == list(range(len(layers_per_stage)))
    for stage, count in zip(report["stages"], layers_per_stage):
        expected = count * layer_params()
        if stage["stage_id"] in (0, last):
            expected += embedding_params()
        if stage["stage_id"] == norm_stage:
            expected += 2 * HIDDEN
        assert stage["params"] == expected, stage["stage_id"]


def check_instruction_counts(report, micro_batches):
    for stage in report["stages"]:
        instructions = stage["instructions"]
        assert instructions["ForwardPass"]["count"] == micro_batches, stage["stage_id"]
        assert instructions["BackwardPass"]["count"] == micro_batches, stage["stage_id"]
        assert instructions["BackwardPass"]["total_s"] > 0, stage["stage_id"]
        assert instructions["OptimizerStep"]["count"] == 1, stage["stage_id"]
