"""The LLaMA shape (grouped-query attention, SwiGLU, RMSNorm, rotary embeddings, untied LM head, no
biases): its flags, its analytic FLOPs, and on the real PipelineEngine (pp2 x tp2, 4 processes) its
exact profile under full and selective recompute and its losses against the same model on one process.
"""
import json
from argparse import Namespace

import pytest

from megatron.arguments import parse_args
from megatron.model.gpt_model import transformer_layers_per_stage
from patches.to_megatron.analytic_flops import gpt_flops_per_iteration, upstream_flops_per_iteration
from tests.helpers.arguments import one_line_exit_2
from tests.helpers.flags import layout
from tests.helpers.launch import TORCHRUN, explain, run_pretrain
from tests.helpers.tiny_llama import LLAMA_FLAGS, TINY_LLAMA, check_totals, expected_flops
from tests.helpers.tiny_llama import dense_params as llama_params

BASE = TINY_LLAMA + ["--train-iters", "5"]
ITERATIONS = 5
PROFILE_STEP = 2
SEQUENCES = 8  # global batch 8, one data-parallel replica


# ------------------------------------------------------------------------------ in process
def _shape(**overrides):
    values = dict(micro_batch_size=1, num_micro_batches=1, seq_length=4, hidden_size=8, num_attention_heads=4,
                  num_key_value_heads=2, kv_channels=2, ffn_hidden_size=12, swiglu=True, num_layers=2,
                  padded_vocab_size=16, checkpoint_activations=False, recompute_granularity=None, global_batch_size=1,
                  recompute_method=None)
    values.update(overrides)
    return Namespace(**values)


def test_analytic_flops_by_hand():
    # per layer, B s = 4 tokens: qkv 2*4*8*(8 + 2*2*2) = 1024, dense 2*4*8*8 = 512, attention
    # 4*1*16*8 = 512, SwiGLU 6*4*8*12 = 2304 -> 4352; 2 layers 8704; head 2*4*8*16 = 1024
    flops = gpt_flops_per_iteration(_shape())
    assert flops == {"fwd_flops": 9728, "bwd_flops": 19456, "recompute_flops": 0}
    assert gpt_flops_per_iteration(_shape(checkpoint_activations=True, recompute_granularity="full"))[
        "recompute_flops"] == 8704
    assert gpt_flops_per_iteration(_shape(recompute_granularity="selective"))["recompute_flops"] == 1024
    # no SwiGLU: 4 B s h f = 1536 per layer instead of 2304
    assert gpt_flops_per_iteration(_shape(swiglu=False))["fwd_flops"] == 9728 - 2 * 768
    # head size other than h / heads: queries 4 x 3 = 12 wide, kv 2 x 3; qkv 2*4*8*(12 + 12) = 1536,
    # dense 2*4*12*8 = 768, attention 4*16*12 = 768, MLP 2304 -> 5376 per layer
    assert gpt_flops_per_iteration(_shape(kv_channels=3))["fwd_flops"] == 2 * 5376 + 1024


def test_analytic_flops_of_gpt2_unchanged():
    # the paper's B s L (24 h^2 + 4 s h) + 2 B s h V for f = 4h, multi-head attention
    args = _shape(num_key_value_heads=4, kv_channels=2, ffn_hidden_size=32, swiglu=False)
    b, s, h, layers, v = 1, 4, 8, 2, 16
    assert gpt_flops_per_iteration(args)["fwd_flops"] == b * s * layers * (24 * h * h + 4 * s * h) + 2 * b * s * h * v
    # upstream's convention: every GEMM 3x (forward and backward), the LM head included
    upstream_macs = b * layers * (4 * h * h * s + 2 * h * s * s + 2 * 32 * h * s) + b * v * h * s
    assert upstream_flops_per_iteration(args) == 2 * 3 * upstream_macs


def test_upstream_convention_for_llama():
    # upstream per layer and token in MACs: (2 + 2 // 2) h^2 = 192, 2 d n s = 64, 3 f h = 288; head 128
    args = _shape()
    forward_macs = 2 * 4 * (192 + 64 + 288) + 4 * 128
    assert upstream_flops_per_iteration(args) == 2 * 3 * forward_macs
    selective = _shape(recompute_granularity="selective")
    assert upstream_flops_per_iteration(selective) == 2 * (3 * forward_macs + 2 * 4 * 64)


def test_tiny_llama_flags_parse():
    args = parse_args(BASE + layout(pp=2, tp=2) + ["--global-batch-size", "8"], world_size=4)
    assert (args.num_key_value_heads, args.kv_channels, args.ffn_hidden_size) == (2, 8, 48)
    assert args.swiglu and args.normalization == "rmsnorm" and not args.add_bias_linear
    args.padded_vocab_size = 192
    fwd, bwd, _, _ = expected_flops(4, SEQUENCES)
    assert gpt_flops_per_iteration(args) == {"fwd_flops": fwd, "bwd_flops": 2 * fwd, "recompute_flops": 0}


@pytest.mark.parametrize("extra, expected", [
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     (True, 2, "full")),
    (["--checkpoint-activations", "--checkpoint-num-layers", "2"], (True, 2, "full")),
    (["--recompute-granularity", "selective"], (False, 1, "selective")),
    (["--recompute-activations"], (False, 1, "selective")),
    (["--deepspeed-activation-checkpointing"], (False, 1, None)),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
     (True, 3, "full")),
])
def test_recompute_flags_map_onto_checkpointing(extra, expected):
    args = parse_args(BASE + extra, world_size=1)
    assert (args.checkpoint_activations, args.checkpoint_num_layers, args.recompute_granularity) == expected


@pytest.mark.parametrize("pp, block_layers, recomputed", [(1, 3, 3), (2, 1, 2), (2, 3, 4), (1, 4, 4)])
def test_block_recompute_counts_the_first_layers_of_each_stage(pp, block_layers, recomputed):
    flags = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
             str(block_layers), "--pipeline-model-parallel-size", str(pp)]
    args = parse_args(BASE + flags, world_size=pp)
    args.padded_vocab_size = 192
    _, _, layer_fwd, _ = expected_flops(4, 2)  # 4 layers, one micro-batch of 2
    per_stage = transformer_layers_per_stage(args)
    assert gpt_flops_per_iteration(args, per_stage)["recompute_flops"] == layer_fwd * recomputed // 4


def test_query_key_layer_scaling_flags():
    assert parse_args(BASE[:-len(LLAMA_FLAGS) - 2] + ["--train-iters", "5"], world_size=1).apply_query_key_layer_scaling
    assert not parse_args(BASE, world_size=1).apply_query_key_layer_scaling
    assert parse_args(BASE + ["--apply-query-key-layer-scaling"], world_size=1).apply_query_key_layer_scaling


BAD = [
    (["--num-key-value-heads", "3"], 1, "--num-key-value-heads 3 must divide --num-attention-heads 4"),
    (["--num-key-value-heads", "1", "--tensor-model-parallel-size", "2"], 2,
     "--num-key-value-heads 1 cannot be split over --tensor-model-parallel-size 2: each tensor rank needs whole "
     "key/value heads"),
    (["--ffn-hidden-size", "47", "--tensor-model-parallel-size", "2"], 2,
     "--ffn-hidden-size 47 is not divisible by --tensor-model-parallel-size 2"),
    (["--normalization", "batchnorm"], 1, "argument --normalization: invalid choice"),
    (["--recompute-method", "uniform"], 1, "--recompute-method needs --recompute-granularity full"),
    (["--recompute-num-layers", "2"], 1, "--recompute-num-layers needs --recompute-granularity full"),
    (["--checkpoint-activations", "--recompute-granularity", "selective"], 1,
     "--checkpoint-activations recomputes full layers; it contradicts --recompute-granularity selective"),
    (["--kv-channels", "0"], 1, "--kv-channels must be >= 1"),
    (["--ffn-hidden-size", "0"], 1, "--ffn-hidden-size must be >= 1"),

    (["--rotary-percent", "0.1"], 1, "gives 0 rotated channels"),
]


@pytest.mark.parametrize("extra, world_size, message", BAD)
def test_bad_model_flags_exit_2_with_one_line(extra, world_size, message, monkeypatch, capsys):
    line = one_line_exit_2(BASE + extra, world_size, monkeypatch, capsys)
    assert message in line, line


def test_swiglu_default_mlp_size_is_upstreams(monkeypatch, capsys):
    at = BASE.index("--ffn-hidden-size")
    without_ffn = BASE[:at] + BASE[at + 2:]
    assert parse_args(without_ffn + ["--hidden-size", "96"], world_size=1).ffn_hidden_size == 256  # 2/3 x 384 = 256
    assert parse_args(without_ffn + ["--hidden-size", "64"], world_size=1).ffn_hidden_size == 128  # 170.7 -> 128
    line = one_line_exit_2(without_ffn + ["--hidden-size", "16"], 1, monkeypatch, capsys)
    assert "rounded down to a multiple of 64, is 0: give --ffn-hidden-size" in line


def test_hidden_size_need_not_divide_with_kv_channels():
    args = parse_args(BASE + ["--hidden-size", "30", "--kv-channels", "8"], world_size=1)
    assert args.kv_channels == 8


# ------------------------------------------------------------------------------ launched
RUNS = {
    # name: (processes, flags)
    "pp2_tp2_full": (4, layout(pp=2, tp=2) + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                              "--recompute-num-layers", "1"]),
    "pp2_tp2_selective": (4, layout(pp=2, tp=2) + ["--recompute-granularity", "selective"]),
    # the first layer of each stage's two
    "pp2_tp2_block": (4, layout(pp=2, tp=2) + ["--recompute-granularity", "full", "--recompute-method", "block",
                                               "--recompute-num-layers", "1"]),
    "pp1_tp1": (1, layout(pp=1, tp=1)),
}
_runs = {}


def _run(tmp_path_factory, name):
    """(losses, report or None) of RUNS[name], launched on first use; pp2 x tp2 runs profile step 2."""
    if name not in _runs:
        nprocs, flags = RUNS[name]
        tmp = tmp_path_factory.mktemp(name)
        flags = LLAMA_FLAGS + ["--train-iters", str(ITERATIONS), "--global-batch-size", "8"] + flags
        if nprocs > 1:
            flags += ["--profile-flops-step", str(PROFILE_STEP), "--profile-flops-output", tmp / "profile"]
        process, losses = run_pretrain(tmp, nprocs, flags, name=name, via=TORCHRUN)
        assert process.returncode == 0, explain(process)
        report_path = tmp / "profile" / f"flops_profile_step{PROFILE_STEP}.json"
        report = json.loads(report_path.read_text()) if nprocs > 1 else None
        _runs[name] = (losses, report)
    return _runs[name]


@pytest.mark.launch
@pytest.mark.parametrize("name, recompute, recomputed_layers", [
    ("pp2_tp2_full", "full", 4), ("pp2_tp2_selective", "selective", 0), ("pp2_tp2_block", "full", 2)])
def test_profile_is_exact(tmp_path_factory, name, recompute, recomputed_layers):
    _, report = _run(tmp_path_factory, name)
    check_totals(report, SEQUENCES, recompute, recomputed_layers)
    assert report["totals"]["params"] == llama_params()
    assert report["activation_checkpointing"] is (recompute == "full")


def _attention_cores(node, path=""):
    for child in node["children"]:
        child_path = f"{path}/{child['name']}"
        if child["type"] == "CoreAttention":
            yield child_path, child
        yield from _attention_cores(child, child_path)


@pytest.mark.launch
def test_block_recompute_reruns_the_first_layer_of_each_stage(tmp_path_factory):
    _, report = _run(tmp_path_factory, "pp2_tp2_block")
    for stage in report["stages"]:
        layers = sorted((child for child in stage["modules"]["children"]
                         if child["type"] == "ParallelTransformerLayerPipe"), key=lambda child: int(child["name"]))
        assert [layer["recompute_flops"] == layer["fwd_flops"] > 0 for layer in layers] == [True, False]
        assert layers[1]["recompute_flops"] == 0


@pytest.mark.launch
def test_selective_recompute_reruns_the_attention_core_only(tmp_path_factory):
    _, report = _run(tmp_path_factory, "pp2_tp2_selective")
    for stage in report["stages"]:
        cores = list(_attention_cores(stage["modules"]))
        assert len(cores) == 2, stage["stage_id"]  # 2 layers per stage
        assert stage["modules"]["recompute_flops"] == sum(core["recompute_flops"] for _, core in cores) > 0
        for _, core in cores:
            assert core["recompute_flops"] == core["fwd_flops"]


@pytest.mark.launch
@pytest.mark.parametrize("name", ["pp2_tp2_full", "pp2_tp2_selective", "pp2_tp2_block"])
def test_losses_match_one_process(tmp_path_factory, name):
    reference, _ = _run(tmp_path_factory, "pp1_tp1")
    losses, _ = _run(tmp_path_factory, name)
    assert sorted(losses) == sorted(reference) == list(range(1, ITERATIONS + 1))
    for iteration, loss in reference.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-4), iteration
