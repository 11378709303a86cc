"""Megatron-DeepSpeed's GPT-125M rebase script (sizes shrunk) run here at pipeline 2 x tensor 2, 4 CPU
processes, once under the `deepspeed` launcher and once under `torchrun`: it trains until its
--train-tokens are consumed (3 iterations), profiles iteration 2, prints one report whose forward
FLOPs equal the analytic formula, and prints upstream's log line. An unsupported upstream flag stops
all 4 ranks with one line.

The script's fp16 needs a float16-capable accelerator; on a CPU without one, the run uses bf16 (its
--fp16 becomes --bf16 and the config's fp16 section a bf16 one), which the FLOPs do not depend on.
"""
import json
import os
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from deepspeed.accelerator import get_accelerator

from megatron.analytic_flops import gpt_flops_per_iteration, upstream_flops_per_iteration
from megatron.arguments import build_parser, parse_args
from megatron.profiler.report import validate_report
from megatron.tokenizer.tokenizer import vocab_size_with_padding
from megatron.training_log import FIELD_ORDER
from tests.helpers.launch import REPO, explain, free_port, launch, remove_shm_buffers
from tests.helpers.upstream_scripts import (
    FLAG_OWNERS,
    GPT_125M,
    GPT_125M_ITERATIONS,
    GPT_125M_TRAIN_SAMPLES,
    LLAMA2,
    gpt_125m_args,
    gpt_125m_ds_config,
    gpt_125m_tokens_per_iteration,
    llama2_args,
    llama2_ds_config,
    pending_flags,
    without_flags,
)

pytestmark = pytest.mark.launch

PROFILE_STEP = 2
NPROCS = GPT_125M["mp_size"] * GPT_125M["pp_size"]
PRECISION = "fp16" if get_accelerator().is_fp16_supported() else "bf16"
DEMO = REPO / "tools" / "demo_corpus"
HEADER = "DeepSpeed Flops Profiler"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The demo corpus as an mmap indexed dataset (about a second)."""
    prefix = tmp_path_factory.mktemp("corpus") / "demo"
    subprocess.run([sys.executable, REPO / "tools" / "preprocess_data.py", "--input", DEMO / "docs.jsonl",
                    "--output-prefix", prefix, "--vocab-file", DEMO / "vocab.json", "--merge-file",
                    DEMO / "merges.txt", "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "1"],
                   check=True, capture_output=True, timeout=120)
    return f"{prefix}_text_document"


def script_args(tmp, corpus):
    config = gpt_125m_ds_config(tmp / "ds_config_gbs8_mbs2_log1_zero1.json", precision=PRECISION)
    argv = gpt_125m_args(corpus, DEMO / "vocab.json", DEMO / "merges.txt", config, tmp / "checkpoint",
                         tmp / "tensorboard", precision=PRECISION)
    # Flags still to come from another part of the fork (none once every part is in); see test_upstream_flags.
    pending = [flag for flags in pending_flags(argv, build_parser()).values() for flag in flags]
    return without_flags(argv, pending)


def torchrun(script, nprocs, script_args, cwd, timeout=300):
    """`torchrun --nproc_per_node N script args` on CPU; removes DeepSpeed's /dev/shm buffers after."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(nprocs), "--master_port",
               str(port), str(script)] + script_args
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    try:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        remove_shm_buffers(port)


@pytest.fixture(scope="module", params=["deepspeed", "torchrun"])
def run(request, tmp_path_factory, corpus):
    """(output, args as the ranks parsed them, tmp) of the script's run under one launcher."""
    tmp = tmp_path_factory.mktemp(f"gpt125m_{request.param}")
    argv = script_args(tmp, corpus) + ["--profile-flops-step", str(PROFILE_STEP), "--profile-flops-output",
                                       str(tmp / "profile")]
    args = parsed(argv)  # before the run: afterwards its checkpoint is in --load
    if request.param == "deepspeed":
        process = launch(REPO / "pretrain_gpt.py", NPROCS, argv, cwd=tmp, timeout=400)
    else:
        process = torchrun(REPO / "pretrain_gpt.py", NPROCS, argv, cwd=tmp, timeout=400)
    assert process.returncode == 0, explain(process)
    return process.stdout + process.stderr, args, tmp


def parsed(argv):
    """The run's args as its ranks parse them, with the tokenizer's padded vocabulary."""
    args = parse_args(argv, world_size=NPROCS)
    vocab = len(json.loads((DEMO / "vocab.json").read_text()))
    args.padded_vocab_size = vocab_size_with_padding(vocab, Namespace(**{**vars(args), "rank": 1}))
    return args


def log_lines(output):
    return [line for line in output.splitlines() if line.startswith(" iteration ")]


def test_trains_to_its_token_budget_and_prints_one_report(run):
    output, args, tmp = run
    assert output.count(HEADER) == 1 and output.count(f"Profile Summary at step {PROFILE_STEP}:") == 1
    report = json.loads((tmp / "profile" / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    validate_report(report)
    analytic = gpt_flops_per_iteration(args)
    assert report["totals"]["fwd_flops"] == analytic["fwd_flops"]
    assert report["totals"]["recompute_flops"] == analytic["recompute_flops"] > 0
    assert f"> training done: {GPT_125M_ITERATIONS} iterations" in output
    assert "Traceback" not in output
    # The script's no-op switch is named once; no flag of the script is reported unknown.
    assert output.count("> accepted, no effect here: --no-async-tensor-model-parallel-allreduce") == 1


def test_log_line_has_upstream_fields_in_order(run):
    output, args, _ = run
    lines = log_lines(output)
    assert len(lines) == GPT_125M_ITERATIONS, output[-3000:]
    expected_fields = [f for f in FIELD_ORDER if f not in ("loss scale", "params norm")]
    if PRECISION == "fp16":
        expected_fields.insert(expected_fields.index("grad norm"), "loss scale")
    tokens = gpt_125m_tokens_per_iteration()
    for iteration, line in enumerate(lines, start=1):
        fields = [part.strip() for part in line.strip().rstrip("|").split(" | ")]
        names = [field.rsplit(":", 1)[0] if ":" in field else field.split()[0] for field in fields]
        assert names == expected_fields, line
        values = dict(field.rsplit(": ", 1) for field in fields[1:])
        assert fields[0] == f"iteration {iteration:8d}/{GPT_125M_TRAIN_SAMPLES // GPT_125M['global_batch_size']:8d}"
        assert int(values["consumed samples"]) == iteration * GPT_125M["global_batch_size"]
        assert int(values["consumed tokens"]) == iteration * tokens
        assert int(values["global batch size"]) == GPT_125M["global_batch_size"]
        assert int(values["actual seqlen"]) == GPT_125M["seq_len"]
        assert int(values["number of skipped iterations"]) == 0 and int(values["number of nan iterations"]) == 0
        assert float(values["lm loss"]) > 0 and float(values["grad norm"]) > 0
        # upstream's throughput convention, from the printed time (1 ms resolution: compare loosely)
        seconds = float(values["elapsed time per iteration (ms)"]) / 1000.0
        samples_per_second = float(values["samples per second"])
        assert samples_per_second == pytest.approx(GPT_125M["global_batch_size"] / seconds, rel=0.01)
        assert float(values["tokens per gpu per second (tgs)"]) == pytest.approx(
            samples_per_second * GPT_125M["seq_len"] / NPROCS, rel=1e-3)
        assert float(values["TFLOPs"]) == pytest.approx(
            upstream_flops_per_iteration(args) / (seconds * NPROCS) / 1e12, abs=0.006)
    # token warm-up: iterations 1 and 2 see lr 0 (upstream counts tokens consumed before an iteration),
    # so the lr printed after iteration 1 (for iteration 2) is 0, after iteration 2 it is the full lr
    learning_rates = [float(re.search(r"learning rate: (\S+) \|", line).group(1)) for line in lines]
    assert learning_rates[0] == 0.0 and learning_rates[1] == pytest.approx(float(GPT_125M["lr"]), rel=1e-3)


def test_tensorboard_gets_upstream_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, tmp = run
    events = EventAccumulator(str(tmp / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("lm-loss-training/lm loss", "lm-loss-training/lm loss vs tokens", "learning-rate/learning-rate",
                "batch-size/batch-size", "iteration-time/iteration-time", "grad-norm/grad-norm",
                "optimizer/variance_l2", "optimizer/momentum_abs_max", "optimizer/weight_l1",
                "lm-loss-validation/lm loss validation", "lm-loss-validation/lm loss validation ppl"):
        assert tag in tags, tag
    assert [e.step for e in events.Scalars("lm-loss-training/lm loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("batch-size/batch-size")] == [8.0, 8.0, 8.0]


def test_unsupported_flag_stops_every_rank_with_one_line(tmp_path, corpus):
    argv = script_args(tmp_path, corpus) + ["--num-experts", "4"]
    process = launch(REPO / "pretrain_gpt.py", NPROCS, argv, cwd=tmp_path, timeout=120)
    output = process.stdout + process.stderr
    assert process.returncode == 2, explain(process)
    errors = [line for line in output.splitlines() if "error:" in line]
    assert errors == ["error: --num-experts 4: mixture of experts (MoE) is not supported here (only --num-experts 1 "
                      "is accepted)"], errors
    assert "Traceback" not in output and "unrecognized arguments" not in output


# ------------------------------------------------------------------ the LLaMA-2 script
LLAMA2_NPROCS = LLAMA2["TP"] * LLAMA2["PP"]


def llama2_script_args(tmp, corpus):
    """The LLaMA-2 script's list, its model flags as it spells them, on gloo. While a data flag of it is
    still undefined here (its SentencePiece tokenizer), all its data flags go and the synthetic source
    feeds the run: the model, and so the FLOPs, are the script's either way."""
    tokenizer_model = tmp / "tokenizer.model"
    tokenizer_model.write_bytes(b"")
    argv = llama2_args(corpus, tokenizer_model, tmp / "checkpoint", llama2_ds_config(tmp / "ds_config.json"),
                       backend="gloo")
    pending = pending_flags(argv, build_parser())
    if "data" in pending:
        argv = without_flags(argv, FLAG_OWNERS["data"])
    return without_flags(argv, [flag for flags in pending.values() for flag in flags])


@pytest.fixture(scope="module")
def llama2_run(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("llama2")
    argv = llama2_script_args(tmp, corpus) + ["--profile-flops-step", str(PROFILE_STEP), "--profile-flops-output",
                                              str(tmp / "profile")]
    args = parse_args(argv, world_size=LLAMA2_NPROCS)
    if args.data_path is None:  # the synthetic source's vocabulary, padded as pretrain_gpt.py pads it
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        args.padded_vocab_size = -(-args.synthetic_vocab_size // multiple) * multiple
    else:
        pytest.skip("the script's SentencePiece data: compute its padded vocabulary here once it runs")
    process = launch(REPO / "pretrain_gpt.py", LLAMA2_NPROCS, argv, cwd=tmp, timeout=400)
    assert process.returncode == 0, explain(process)
    return process.stdout + process.stderr, args, tmp


def test_llama2_script_trains_and_profiles_its_model_exactly(llama2_run):
    output, args, tmp = llama2_run
    assert output.count(HEADER) == 1 and "Traceback" not in output
    assert f"> training done: {LLAMA2['TRAIN_STEPS']} iterations" in output
    assert len(log_lines(output)) == LLAMA2["TRAIN_STEPS"]
    # the script's model: grouped-query attention, SwiGLU, RMSNorm, rotary, untied, no biases
    assert (args.num_key_value_heads, args.swiglu, args.normalization) == (LLAMA2["NUM_KV_HEADS"], True, "rmsnorm")
    assert args.untie_embeddings_and_output_weights and not args.add_bias_linear
    assert "accepted, no effect here" not in output  # --no-query-key-layer-scaling is a model flag now
    report = json.loads((tmp / "profile" / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    validate_report(report)
    analytic = gpt_flops_per_iteration(args)
    assert report["totals"]["fwd_flops"] == analytic["fwd_flops"]
    assert report["totals"]["recompute_flops"] == analytic["recompute_flops"] == 0
    assert report["device"]["dtype"] == "bf16"
