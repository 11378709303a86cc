"""Full recompute in chunks of N (--checkpoint-activations --checkpoint-num-layers N).

DeepSpeed's PipelineModule cuts each stage's layers into chunks of N counted from the stage's first layer
and checkpoints a chunk only when all its layers are transformer layers. The tiny GPT's specs are
[embedding, 1, 2, 3, 4, final norm, LM head]; on pp 2 stage 0 holds [embedding, 1, 2] and stage 1
[3, 4, final norm, LM head]. By hand:
    pp 2, N = 1: chunks [e] [1] [2] | [3] [4] [n] [h]     -> layers 1, 2, 3, 4 recomputed
    pp 2, N = 2: chunks [e 1] [2] | [3 4] [n h]           -> layers 2, 3, 4
    pp 2, N = 3: chunks [e 1 2] | [3 4 n] [h]             -> none
    pp 1, N = 2: chunks [e 1] [2 3] [4 n] [h]             -> layers 2, 3
    --no-pipeline-parallel, N = 3: our GPTModel checkpoints [1 2 3] [4]  -> all four
The report's recompute FLOPs must be those layers' forwards, as counted apart from the profiler (a global
forward hook, tests/scripts/count_recomputed_layers.py), the analytic figure must follow the same layers,
and where fewer layers than all are recomputed, the start-up log and the report say which and why.
"""
import json
import re
from argparse import Namespace

import pytest

from megatron.arguments import parse_args
from megatron.model.gpt_model import pipeline_stage_layers, transformer_layers_per_stage
from patches.profiler.files import validate_report
from patches.to_megatron.analytic_flops import (
    gpt_flops_per_iteration,
    pipeline_recomputed_layers,
    recompute_shortfall,
    recomputed_layers,
)
from tests.helpers.flags import TINY_GPT, layout
from tests.helpers.launch import REPO, TORCHRUN, explain, launch
from tests.helpers.recompute_count import ranks_that_counted, recompute_calls
from tests.helpers.tiny_gpt import expected_flops

LAYERS, MICRO_BATCHES, SEQUENCES = 4, 4, 8  # global batch 8 of micro-batches of 2
RUNS = {  # name: (processes, flags, N, the layers recomputed, by hand)
    "pp2_n1": (2, layout(pp=2), 1, [1, 2, 3, 4]),
    "pp2_n2": (2, layout(pp=2), 2, [2, 3, 4]),
    "pp2_n3": (2, layout(pp=2), 3, []),
    "pp1_n2": (1, layout(pp=1), 2, [2, 3]),
    "no_pp_n3": (1, ["--no-pipeline-parallel"] + layout(pp=1), 3, [1, 2, 3, 4]),
}
SHORTFALL_PP2_N2 = (
    "activation checkpointing recomputes 3 of 4 transformer layers (2, 3, 4; not 1): DeepSpeed's PipelineModule "
    "checkpoints a chunk of --checkpoint-num-layers 2 layers, counted from each stage's first layer, only when all "
    "its layers are transformer layers, unlike stage 0's [embedding, layer 1]")
SHORTFALL_PP2_N3 = (
    "activation checkpointing recomputes 0 of 4 transformer layers (none; not 1, 2, 3, 4): DeepSpeed's "
    "PipelineModule checkpoints a chunk of --checkpoint-num-layers 3 layers, counted from each stage's first "
    "layer, only when all its layers are transformer layers, unlike stage 0's [embedding, layer 1, layer 2] and "
    "stage 1's [layer 3, layer 4, final norm]")


def _flags(name):
    _, flags, n, _ = RUNS[name]
    return flags + ["--global-batch-size", "8", "--train-iters", "1", "--checkpoint-activations",
                    "--checkpoint-num-layers", str(n)]


def _args(name):
    processes = RUNS[name][0]
    args = parse_args(TINY_GPT + _flags(name), world_size=processes)
    args.padded_vocab_size = 192
    args.num_micro_batches = MICRO_BATCHES
    return args


LAYER_FWD = expected_flops(LAYERS, SEQUENCES)[2] // LAYERS  # one layer's forward over the iteration


# ---------------------------------------------------------------- in process: the rule, the analytic, the line
@pytest.mark.parametrize("name", RUNS)
def test_analytic_recompute_follows_the_layers_by_hand(name):
    args = _args(name)
    recomputed = RUNS[name][3]
    stages = pipeline_stage_layers(args)
    assert recomputed_layers(args, stage_layers=stages) == len(recomputed)
    analytic = gpt_flops_per_iteration(args, stage_layers=stages)
    assert analytic["recompute_flops"] == len(recomputed) * LAYER_FWD
    assert analytic["fwd_flops"] == expected_flops(LAYERS, SEQUENCES)[0]
    if not args.no_pipeline_parallel:
        assert pipeline_recomputed_layers(stages, args.checkpoint_num_layers) == recomputed


def test_stage_layers_of_the_tiny_gpt():
    assert pipeline_stage_layers(_args("pp2_n2")) == [["embedding", 1, 2], [3, 4, "final norm", "LM head"]]
    assert pipeline_stage_layers(_args("pp1_n2")) == [["embedding", 1, 2, 3, 4, "final norm", "LM head"]]


@pytest.mark.parametrize("name, line", [("pp2_n1", None), ("pp2_n2", SHORTFALL_PP2_N2), ("pp2_n3", SHORTFALL_PP2_N3),
                                        ("no_pp_n3", None)])
def test_the_shortfall_line(name, line):
    args = _args(name)
    assert recompute_shortfall(args, pipeline_stage_layers(args)) == line


def test_block_recompute_and_no_stage_layers_keep_their_counts():
    args = _args("pp2_n3")
    assert recomputed_layers(args) == LAYERS  # no stage layers given: every layer, as before
    block = Namespace(**{**vars(args), "recompute_method": "block", "checkpoint_num_layers": 1})
    assert recomputed_layers(block, stage_layers=pipeline_stage_layers(block)) == 2
    assert recomputed_layers(block, transformer_layers_per_stage(block)) == 2
    assert recompute_shortfall(block, pipeline_stage_layers(block)) is None


# ---------------------------------------------------------------- launched: what really ran again
_runs = {}


def _run(name, tmp_path_factory):
    """One profiled iteration per layout (launched once, shared by the tests below):
    (output, report, {layer: recompute calls summed over ranks})."""
    if name not in _runs:
        tmp = tmp_path_factory.mktemp(name)
        flags = TINY_GPT + _flags(name) + ["--profile-flops-step", "1", "--profile-flops-output", tmp]
        process = launch(REPO / "tests" / "scripts" / "count_recomputed_layers.py", RUNS[name][0], flags, cwd=tmp,
                         via=TORCHRUN)
        assert process.returncode == 0, explain(process)
        output = process.stdout + process.stderr
        calls = recompute_calls(output)
        assert ranks_that_counted(output) == RUNS[name][0]
        _runs[name] = output, json.loads((tmp / "flops_profile_step1.json").read_text()), calls
    return _runs[name]


@pytest.mark.launch
@pytest.mark.parametrize("name", RUNS)
def test_recompute_flops_are_the_layer_forwards_that_ran_again(name, tmp_path_factory):
    output, report, calls = _run(name, tmp_path_factory)
    recomputed = RUNS[name][3]
    assert calls == {layer: MICRO_BATCHES for layer in recomputed}  # the hook's count, apart from the profiler
    validate_report(report)
    fwd, bwd, _ = expected_flops(LAYERS, SEQUENCES)
    totals = report["totals"]
    assert (totals["fwd_flops"], totals["bwd_flops"]) == (fwd, bwd)
    assert totals["recompute_flops"] == len(recomputed) * LAYER_FWD
    assert report["activation_checkpointing"] is True  # --no-pipeline-parallel too: our GPTModel checkpoints


@pytest.mark.launch
@pytest.mark.parametrize("name", RUNS)
def test_analytic_recompute_equals_the_measured(name, tmp_path_factory):
    output, report, _ = _run(name, tmp_path_factory)
    totals = report["totals"]
    assert totals["analytic"] == gpt_flops_per_iteration(_args(name), stage_layers=pipeline_stage_layers(_args(name)))
    assert totals["analytic"]["recompute_flops"] == totals["recompute_flops"]
    fwd, bwd, _ = expected_flops(LAYERS, SEQUENCES)
    recompute = len(RUNS[name][3]) * LAYER_FWD
    # measured bwd has the CPU flash kernel's 5 attention GEMMs where the formula has 4: the same ratio for every N
    ratio = (fwd + bwd + recompute) / (3 * fwd + recompute)
    assert totals["measured_over_analytic"] == ratio
    assert re.search(rf"measured / analytic:\s+{ratio:.4f}\n", output)


@pytest.mark.launch
@pytest.mark.parametrize("name", RUNS)
def test_a_shortfall_is_said_once_in_the_log_and_once_in_the_report(name, tmp_path_factory):
    output, report, _ = _run(name, tmp_path_factory)
    args = _args(name)
    line = recompute_shortfall(args, pipeline_stage_layers(args))
    assert (line is None) == (len(RUNS[name][3]) == LAYERS)
    assert report["recompute_note"] == line
    if line is None:
        assert "activation checkpointing recomputes" not in output and "recomputed layers:" not in output
        return
    assert output.count(f"> {line}\n") == 1  # the start-up log, rank 0
    assert len(re.findall(rf"recomputed layers:\s+{re.escape(line)}\n", output)) == 1  # the report
