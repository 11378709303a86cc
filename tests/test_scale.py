"""Scale and shape: the profiler holds for many stages, uneven and embedding-only stages, one or many
micro-batches, and ZeRO stage 1 under the pipeline. Exact params and analytic FLOPs throughout."""
import json

import pytest

from patches.profiler.printer import HEADER
from tests.helpers.flags import TINY_GPT, layout
from tests.helpers.launch import TORCHRUN, explain, run_pretrain
from tests.helpers.multinode import PROFILE_STEP, two_node_profile
from tests.helpers.tiny_gpt import (
    HIDDEN,
    LAYER_TYPE,
    SEQ,
    VOCAB,
    check_instruction_counts,
    check_stage_params,
    check_totals,
    stage_layers,
)

pytestmark = pytest.mark.launch



def profile(tmp_path, nprocs, flags, step=1, timeout=300):
    """Run the tiny GPT with `flags` (later flags win), profile iteration `step`; returns (process, report)."""
    flags = TINY_GPT + flags + ["--profile-flops-step", str(step), "--profile-flops-output", tmp_path / "profile"]
    process, _ = run_pretrain(tmp_path, nprocs, flags, timeout=timeout, via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    assert (process.stdout + process.stderr).count(HEADER) == 1
    return process, json.loads((tmp_path / "profile" / f"flops_profile_step{step}.json").read_text())


def test_pipeline_8_on_8_ranks(tmp_path):
    """8 stages of one layer each, 8 micro-batches, activation checkpointing."""
    _, report = profile(tmp_path, 8, ["--num-layers", "8"] + layout(pp=8)
                        + ["--global-batch-size", "16", "--train-iters", "1", "--checkpoint-activations"])
    assert report["parallelism"]["pipeline_parallel_size"] == 8
    assert [stage["global_ranks"] for stage in report["stages"]] == [[rank] for rank in range(8)]
    check_totals(report, layers=8, sequences=16, checkpointing=True)
    check_stage_params(report, [1] * 8)
    assert stage_layers(report) == [[index] for index in range(1, 9)]
    check_instruction_counts(report, micro_batches=8)


def test_uneven_partition_and_a_single_micro_batch(tmp_path):
    """5 layers on 2 stages (3 + 2), one micro-batch: the 1F1B schedule degenerates to F, B per stage."""
    flags = ["--num-layers", "5"] + layout(pp=2) + ["--global-batch-size", "2", "--train-iters", "1"]
    _, report = profile(tmp_path, 2, flags)
    assert report["parallelism"]["micro_batches"] == 1
    check_totals(report, layers=5, sequences=2, checkpointing=False)
    assert stage_layers(report) == [[1, 2, 3], [4, 5]]
    check_stage_params(report, [3, 2])
    check_instruction_counts(report, micro_batches=1)


def test_embedding_only_stage_and_many_micro_batches(tmp_path_factory):
    """Megatron-DeepSpeed's 'type:transformer|embedding' partition on 4 stages of a 2-layer model:
    stage 0 holds only the embedding, stage 3 only the tied LM head; 16 micro-batches on 4 stages.
    (The two-node run of multinode.RUNS, shared with test_multinode.)"""
    report = two_node_profile(tmp_path_factory, "pp4_embedding_stage").report
    assert report["parallelism"]["micro_batches"] == 16
    check_totals(report, layers=2, sequences=32, checkpointing=True)
    assert stage_layers(report) == [[], [1], [2], []]
    check_stage_params(report, [0, 1, 1, 0], norm_stage=2)
    # (every stage has a tied_modules ModuleDict; it is empty on the middle ones)
    held = [[child["type"] for child in stage["modules"]["children"] if child["params"]] for stage in report["stages"]]
    assert held == [["ModuleDict"], [LAYER_TYPE], [LAYER_TYPE, "LayerNorm"], ["ModuleDict"]]
    # The embedding stage computes no GEMM in forward; the head stage's forward is the LM head alone.
    assert report["stages"][0]["fwd_flops"] == 0
    assert report["stages"][3]["fwd_flops"] == 2 * 32 * SEQ * HIDDEN * VOCAB
    assert [stage["recompute_flops"] > 0 for stage in report["stages"]] == [False, True, True, False]
    check_instruction_counts(report, micro_batches=16)


def test_zero_stage_1_with_the_pipeline(tmp_path_factory):
    """pp 2 x dp 2 with ZeRO stage 1: optimizer states partitioned over dp, parameters still counted whole.
    (The two-node run of multinode.RUNS, shared with test_multinode.)"""
    run = two_node_profile(tmp_path_factory, "pp2_dp2_zero1")
    report = run.report
    check_totals(report, layers=4, sequences=2 * 2, checkpointing=False)
    check_stage_params(report, [2, 2])
    check_instruction_counts(report, micro_batches=2)
    # ZeRO was on: each data-parallel rank saved its own partition of each stage's optimizer states.
    checkpoint = run.directory / "checkpoints" / f"global_step{PROFILE_STEP}"
    saved = sorted(path.name for path in checkpoint.glob("zero_pp_rank_*"))
    assert saved == [f"zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt" for dp in (0, 1) for stage in (0, 1)]
