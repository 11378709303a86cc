"""Megatron-DeepSpeed's GPT-125M rebase script (sizes shrunk) run here at pipeline 2 x tensor 2, 4 CPU
processes, once under the `deepspeed` launcher and once under `torchrun`: it trains until its
--train-tokens are consumed (3 iterations), profiles iteration 2, prints one report whose forward
FLOPs equal the analytic formula, and prints upstream's log line. The LLaMA-2 script runs under `torchrun`,
its own launcher (the `deepspeed` launcher's path is the GPT-125M run's). An unsupported upstream flag's
one line is checked in process (test_upstream_flags.py); that such a line stops every launched rank, by
test_arguments.py's launched test.

The script's fp16 needs a float16-capable accelerator; on a CPU without one, the run uses bf16 (its
--fp16 becomes --bf16 and the config's fp16 section a bf16 one), which the FLOPs do not depend on.
"""
import json
import re
from argparse import Namespace

import pytest
from deepspeed.accelerator import get_accelerator

from megatron.arguments import parse_args
from megatron.tokenizer.tokenizer import vocab_size_with_padding
from megatron.training_log import FIELD_ORDER
from patches.profiler.files import validate_report
from patches.profiler.printer import HEADER
from patches.to_megatron.analytic_flops import gpt_flops_per_iteration, upstream_flops_per_iteration
from tests.helpers.corpus import (
    SENTENCEPIECE_PREFIX,
    demo_documents,
    preprocess_demo_corpus,
    preprocess_with_sentencepiece,
    train_sentencepiece,
)
from tests.helpers.launch import REPO, TORCHRUN, explain, launch
from tests.helpers.upstream_scripts import (
    GPT_125M,
    GPT_125M_ITERATIONS,
    GPT_125M_TRAIN_SAMPLES,
    LLAMA2,
    gpt_125m_args,
    gpt_125m_ds_config,
    gpt_125m_tokens_per_iteration,
    llama2_args,
    llama2_ds_config,
)

pytestmark = pytest.mark.launch

PROFILE_STEP = 2
NPROCS = GPT_125M["mp_size"] * GPT_125M["pp_size"]
PRECISION = "fp16" if get_accelerator().is_fp16_supported() else "bf16"
DEMO = REPO / "tools" / "demo_corpus"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return preprocess_demo_corpus(tmp_path_factory.mktemp("corpus"))


def script_args(tmp, corpus):
    config = gpt_125m_ds_config(tmp / "ds_config_gbs8_mbs2_log1_zero1.json", precision=PRECISION)
    return gpt_125m_args(corpus, DEMO / "vocab.json", DEMO / "merges.txt", config, tmp / "checkpoint",
                         tmp / "tensorboard", precision=PRECISION)


@pytest.fixture(scope="module", params=["deepspeed", "torchrun"])
def run(request, tmp_path_factory, corpus):
    """(output, args as the ranks parsed them, tmp) of the script's run under one launcher."""
    tmp = tmp_path_factory.mktemp(f"gpt125m_{request.param}")
    argv = script_args(tmp, corpus) + ["--profile-flops-step", str(PROFILE_STEP), "--profile-flops-output",
                                       str(tmp / "profile")]
    args = parsed(argv)  # before the run: afterwards its checkpoint is in --load
    process = launch(REPO / "pretrain_gpt.py", NPROCS, argv, cwd=tmp, timeout=400, via=request.param)
    assert process.returncode == 0, explain(process)
    return process.stdout + process.stderr, args, tmp


def parsed(argv):
    """The run's args as its ranks parse them, with the tokenizer's padded vocabulary."""
    args = parse_args(argv, world_size=NPROCS)
    vocab = len(json.loads((DEMO / "vocab.json").read_text()))
    args.padded_vocab_size = vocab_size_with_padding(vocab, Namespace(**{**vars(args), "rank": 1}))
    return args


def log_lines(output):
    """The training log lines. Ranks share one pipe, so another rank's text may end up just before a
    line (its newline missing): a log line is found wherever it starts, up to its end."""
    return re.findall(r" iteration +\d+/ *\d+ \|[^\n]*", output)


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
    expected_fields = [f for f in FIELD_ORDER if f not in ("loss scale", "num zeros", "params norm")]
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


@pytest.fixture(scope="module")
def sentencepiece_corpus(tmp_path_factory):
    """(dataset prefix, SentencePiece model) of the demo corpus, as the LLaMA script's data and tokenizer."""
    directory = tmp_path_factory.mktemp("sp_corpus")
    documents = demo_documents()
    model_file = train_sentencepiece(directory, documents, vocab_size=500)
    process = preprocess_with_sentencepiece(directory, model_file, documents)
    assert process.returncode == 0, process.stderr
    return str(directory / SENTENCEPIECE_PREFIX), model_file


def test_llama2_script_trains_and_profiles_exactly(tmp_path, sentencepiece_corpus):
    """The script's torchrun command line (pretrain_llama2_distributed.sh), backend gloo."""
    data_path, model_file = sentencepiece_corpus
    config = llama2_ds_config(tmp_path / "ds_config.json")
    argv = llama2_args(data_path, model_file, tmp_path / "checkpoint", config, backend="gloo")
    argv += ["--profile-flops-step", str(PROFILE_STEP), "--profile-flops-output", str(tmp_path / "profile")]
    nprocs = LLAMA2["TP"] * LLAMA2["PP"]
    args = parse_args(argv, world_size=nprocs)
    args.padded_vocab_size = vocab_size_with_padding(500, Namespace(**{**vars(args), "rank": 1}))
    process = launch(REPO / "pretrain_gpt.py", nprocs, argv, cwd=tmp_path, timeout=400, via=TORCHRUN)
    output = process.stdout + process.stderr
    assert process.returncode == 0, explain(process)
    assert output.count(HEADER) == 1 and "Traceback" not in output
    assert f"> training done: {LLAMA2['TRAIN_STEPS']} iterations" in output
    assert len(log_lines(output)) == LLAMA2["TRAIN_STEPS"]
    report = json.loads((tmp_path / "profile" / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    validate_report(report)
    analytic = gpt_flops_per_iteration(args)
    assert report["totals"]["fwd_flops"] == analytic["fwd_flops"]
    assert report["totals"]["recompute_flops"] == analytic["recompute_flops"] == 0
    assert report["device"]["dtype"] == "bf16"
    # the script's model: grouped-query attention, SwiGLU, RMSNorm, rotary, untied, no biases
    assert (args.num_key_value_heads, args.swiglu, args.normalization) == (LLAMA2["NUM_KV_HEADS"], True, "rmsnorm")
    assert args.untie_embeddings_and_output_weights and not args.add_bias_linear
    assert "accepted, no effect here" not in output  # --no-query-key-layer-scaling is a model flag
