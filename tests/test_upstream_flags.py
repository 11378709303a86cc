"""Upstream Megatron-DeepSpeed's launch-script flags, checked in this process through parse_args.

The GPT-125M rebase script and the LLaMA-2 script parse (every flag they use is known); each upstream
flag for a feature this fork lacks stops the run with one line and exit code 2; the learning-rate
and weight-decay schedule follows upstream's definitions in every style and unit; the fp16 loss
scaling and ZeRO flags map onto the DeepSpeed config; the log line has upstream's fields.
"""
import json
import math

import pytest
import torch

from megatron.arguments import ArgumentError, build_parser, parse_args
from megatron.initialize import check_machine_supports
from megatron.optimizer import get_param_groups
from megatron.optimizer_param_scheduler import OptimizerParamScheduler, SchedulerStateMismatch, schedule_spans
from megatron.training import _exit_reason
from megatron.training_log import FIELD_ORDER, IntervalStats, TrainingLogLine, throughput
from megatron.upstream_flags import NO_OPS
from patches.to_megatron.analytic_flops import upstream_flops_per_iteration
from tests.helpers.arguments import one_line_exit_2
from tests.helpers.corpus import preprocess_demo_corpus
from tests.helpers.launch import REPO
from tests.helpers.upstream_scripts import (
    REBASE_VARIANTS,
    UNSUPPORTED,
    UNSUPPORTED_AT_OFF_VALUE,
    flag_names,
    gpt_125m_args,
    gpt_125m_ds_config,
    llama2_args,
    llama2_ds_config,
    megatron_gpt_args,
    without_flags,
)

DEMO = REPO / "tools" / "demo_corpus"
WORLD = 4  # both scripts: pipeline 2 x tensor 2


@pytest.fixture(autouse=True)
def first_rank(monkeypatch):
    monkeypatch.setenv("RANK", "0")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return preprocess_demo_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def gpt_125m(tmp_path, corpus):
    """The 125M script's flags as it ships them (fp16), its config beside them."""
    config = gpt_125m_ds_config(tmp_path / "ds_config.json", precision="fp16")
    return gpt_125m_args(corpus, DEMO / "vocab.json", DEMO / "merges.txt", config, tmp_path / "checkpoint",
                         tmp_path / "tensorboard")


@pytest.fixture
def llama2(tmp_path, corpus):
    tokenizer_model = tmp_path / "tokenizer.model"
    tokenizer_model.write_bytes(b"")
    return llama2_args(corpus, tokenizer_model, tmp_path / "checkpoint", llama2_ds_config(tmp_path / "ds.json"))


def parses(argv, world_size=WORLD):
    return parse_args([str(a) for a in argv], world_size=world_size)


# ------------------------------------------------------------------------------------- the scripts parse
@pytest.mark.parametrize("script", ["gpt_125m", "llama2"])
def test_every_flag_of_the_scripts_is_known(script, request):
    argv = request.getfixturevalue(script)
    names = set(flag_names(argv)) | {flag for extra in REBASE_VARIANTS.values() for flag in flag_names(extra)}
    known = build_parser()._option_string_actions  # argparse has no public list of its options
    assert sorted(flag for flag in names if flag not in known) == []


@pytest.mark.parametrize("script", ["gpt_125m", "llama2"])
def test_script_parses_whole(script, request):
    parses(request.getfixturevalue(script))


def test_gpt_125m_flags_mean_what_upstream_means(gpt_125m):
    args = parses(gpt_125m)
    assert (args.train_samples, args.train_iters, args.train_tokens) == (40, 5, 768)
    assert (args.lr_warmup_tokens, args.lr_decay_tokens, args.lr_decay_style) == (256, 768, "cosine")
    assert args.override_opt_param_scheduler and args.exit_duration_in_mins == 30000000
    assert (args.adam_beta1, args.adam_beta2, args.weight_decay) == (0.9, 0.95, 0.1)
    assert (args.data_parallel_size, args.num_micro_batches, args.zero_stage) == (1, 4, 1)
    config = args.deepspeed_config_dict
    # the config's fp16 section is kept as written; --hysteresis 2 agrees with it
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                              "min_loss_scale": 1, "initial_scale_power": 11}
    assert config["zero_optimization"] == {"stage": 1} and config["gradient_clipping"] == 1.0
    assert args.fp16 and args.tensorboard_queue_size == 1 and args.log_optimizer_states_to_tensorboard
    assert args.start_up_notes == ["> accepted, no effect here: --no-async-tensor-model-parallel-allreduce "
                                   "(upstream turns it off under DeepSpeed too)"]


def test_llama2_flags_mean_what_upstream_means(llama2):
    args = parses(llama2)
    assert (args.train_iters, args.lr_warmup_iters, args.lr_decay_style, args.optimizer) == (3, 1, "cosine", "adam")
    assert args.bf16 and args.deepspeed_config_dict["bf16"] == {"enabled": True} and args.zero_stage == 0
    assert args.distributed_backend == "nccl" and args.clip_grad == 0.0  # DeepSpeed's bf16 optimizer clips
    assert args.deepspeed_config_dict["gradient_clipping"] == 1.0
    # the model flags, as upstream means them
    assert (args.num_key_value_heads, args.kv_channels, args.ffn_hidden_size) == (2, 16, 172)
    assert args.swiglu and args.normalization == "rmsnorm" and args.use_rotary_position_embeddings
    assert args.untie_embeddings_and_output_weights and not args.add_bias_linear
    assert not args.apply_query_key_layer_scaling and args.recompute_granularity is None
    assert args.start_up_notes == []


def test_megatron_lm_example_flags(tmp_path, corpus):
    """examples/pretrain_gpt.sh: iteration-based, warm-up a fraction (.01) of the 320-iteration decay, fp16
    without a DeepSpeed config (upstream's own loss-scaler defaults)."""
    argv = megatron_gpt_args(corpus, DEMO / "vocab.json", DEMO / "merges.txt", tmp_path / "ckpt")
    args = parses(argv, world_size=2)
    spans = schedule_spans(args)
    assert (spans.lr_warmup_steps, spans.lr_decay_steps, spans.wd_incr_steps) == (0.01 * 320 * 8, 320 * 8, 500 * 8)
    assert args.deepspeed_config_dict["fp16"]["initial_scale_power"] == 32 and args.num_micro_batches == 1


@pytest.mark.parametrize("variant", sorted(REBASE_VARIANTS))
def test_rebase_script_variants_parse(variant, gpt_125m):
    argv = gpt_125m + REBASE_VARIANTS[variant]
    if variant.startswith("ds_pretrain_gpt_1.3B_megatron_checkpointing"):
        # that script trains without --deepspeed, --deepspeed_config, --zero-stage and recomputes by
        # the new flags instead of --checkpoint-activations
        argv = without_flags(argv, ["--deepspeed", "--deepspeed_config", "--zero-stage", "--checkpoint-activations",
                                    "--deepspeed-activation-checkpointing"])
    if "--no-pipeline-parallel" in argv:
        args = parses(without_flags(argv, ["--pipeline-model-parallel-size"]), world_size=2)
    else:
        args = parses(argv)
    # every variant recomputes full layers, one per chunk (the 125M script's --checkpoint-activations,
    # or the checkpointing script's --recompute-* flags)
    assert (args.checkpoint_activations, args.checkpoint_num_layers, args.recompute_granularity) == (True, 1, "full")
    if variant.endswith("rope.sh"):
        assert args.use_rotary_position_embeddings and args.rotary_percent == 0.25


def test_upstream_defaults():
    args = parses(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                   "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "5"], world_size=1)
    assert (args.lr_decay_style, args.eval_iters, args.eval_interval, args.min_lr) == ("linear", 100, 1000, 0.0)
    assert (args.weight_decay, args.clip_grad, args.adam_eps, args.optimizer) == (0.01, 1.0, 1e-8, "adam")
    assert (args.adam_beta1, args.adam_beta2, args.sgd_momentum, args.seed) == (0.9, 0.999, 0.9, 1234)
    assert (args.log_interval, args.tensorboard_queue_size, args.lr_warmup_iters) == (100, 1000, 0)
    assert args.zero_stage == 0 and args.start_up_notes == []


# ------------------------------------------------------------------------------------- refused, accepted
@pytest.mark.parametrize("extra,words", UNSUPPORTED, ids=[extra[0] for extra, _ in UNSUPPORTED])
def test_unsupported_flag_exits_2_with_one_line(extra, words, gpt_125m, monkeypatch, capsys):
    line = one_line_exit_2(gpt_125m + extra, WORLD, monkeypatch, capsys)
    assert line.startswith(f"error: {extra[0]}") and "is not supported here" in line and words in line, line


def test_the_125m_script_with_num_experts_4_stops_with_this_one_line(gpt_125m, monkeypatch, capsys):
    """The whole line. Under the launcher, a flag refused here stops every rank with this one line and exit 2, no
    traceback (test_arguments.py::test_every_launched_rank_exits_2_without_hanging, the same refusal path)."""
    line = one_line_exit_2(gpt_125m + ["--num-experts", "4"], WORLD, monkeypatch, capsys)
    assert line == ("error: --num-experts 4: mixture of experts (MoE) is not supported here (only --num-experts 1 "
                    "is accepted)")


@pytest.mark.parametrize("extra", UNSUPPORTED_AT_OFF_VALUE, ids=[extra[0] for extra in UNSUPPORTED_AT_OFF_VALUE])
def test_unsupported_feature_at_its_off_value_is_accepted(extra, gpt_125m):
    parses(gpt_125m + extra)


@pytest.mark.parametrize("flag,successor", [("--batch-size", "--micro-batch-size"), ("--warmup", "--lr-warmup"),
                                            ("--model-parallel-size", "--tensor-model-parallel-size")])
def test_flags_upstream_retired_name_their_successor(flag, successor, gpt_125m, monkeypatch, capsys):
    line = one_line_exit_2(gpt_125m + [flag, "4"], WORLD, monkeypatch, capsys)
    assert line.startswith(f"error: {flag} is no longer valid") and successor in line


def test_curriculum_config_section_exits_2(tmp_path, gpt_125m, monkeypatch, capsys):
    """ds_config_gpt_slw_TEMPLATE.json (the RoPE + sequence-length-warm-up script) enables curriculum learning."""
    config = json.loads(gpt_125m_ds_config(tmp_path / "c.json").read_text())
    config["curriculum_learning"] = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                                     "max_difficulty": 32, "schedule_type": "fixed_linear",
                                     "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}
    (tmp_path / "slw.json").write_text(json.dumps(config))
    argv = gpt_125m
    argv[argv.index("--deepspeed_config") + 1] = str(tmp_path / "slw.json")
    line = one_line_exit_2(argv, WORLD, monkeypatch, capsys)
    assert line == "error: DeepSpeed config section 'curriculum_learning': curriculum learning is not supported here"


def test_unknown_flag_is_argparse_one_line(gpt_125m, monkeypatch, capsys):
    line = one_line_exit_2(gpt_125m + ["--no-such-flag"], WORLD, monkeypatch, capsys)
    assert line == "error: unrecognized arguments: --no-such-flag"


def test_no_op_switches_are_listed_in_one_line(gpt_125m):
    switches = [entry.flags[0] for entry in NO_OPS if entry.value_type is None]
    args = parses(gpt_125m + switches + ["--empty-unused-memory-level", "1"])
    assert len(args.start_up_notes) == 1
    note = args.start_up_notes[0]
    assert note.startswith("> accepted, no effect here: ")
    for flag in switches + ["--empty-unused-memory-level"]:
        assert note.count(f"{flag} (") == 1, flag


# ------------------------------------------------------------------------------------- schedule flags
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4"]  # global batch 8 x 16 = 128 tokens
TOKENS = 128


@pytest.mark.parametrize("extra,expected", [
    ([], "give exactly one of --train-iters and --train-samples"),
    (["--train-iters", "5", "--train-samples", "40"], "give exactly one of --train-iters and --train-samples"),
    (["--train-iters", "5", "--lr-decay-samples", "40"], "--lr-decay-samples needs sample-based training"),
    (["--train-iters", "5", "--lr-warmup-samples", "8"], "--lr-warmup-samples needs sample-based training"),
    (["--train-samples", "40", "--lr-decay-iters", "5"], "--lr-decay-iters needs iteration-based training"),
    (["--train-samples", "40", "--lr-warmup-iters", "1"], "--lr-warmup-iters needs iteration-based training"),
    (["--train-iters", "5", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"],
     "give only one of --lr-warmup-fraction and --lr-warmup-iters"),
    (["--train-samples", "4"], "--train-samples 4 is less than one global batch (8 samples)"),
    (["--train-iters", "5", "--min-lr", "0.1"], "--min-lr 0.1 must be between 0 and --lr 0.001"),
    (["--train-iters", "5", "--start-weight-decay", "0.1"], "--start-weight-decay needs --weight-decay-incr-style"),
    (["--train-iters", "5", "--weight-decay-incr-style", "linear"], "needs --start-weight-decay and --end-weight"),
    (["--train-iters", "5", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.2",
      "--end-weight-decay", "0.1"], "weight decay must be >= 0 and may only grow"),
    (["--train-iters", "5", "--lr-decay-style", "square"], "argument --lr-decay-style: invalid choice"),
    (["--train-iters", "5", "--optimizer", "lamb"], "argument --optimizer: invalid choice"),
    (["--train-iters", "5", "--train-tokens", "256", "--profile-flops-step", "3"],
     "--profile-flops-step 3 would never run: --train-tokens 256 is reached at iteration 2"),
    (["--train-iters", "5", "--fp16", "--initial-loss-scale", "1000"], "--initial-loss-scale 1000 is not a power of 2"),
    (["--train-iters", "5", "--exit-interval", "0"], "--exit-interval must be positive"),
    (["--train-iters", "5", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
     "give only one of --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler"),
])
def test_bad_schedule_exits_2_with_one_line(extra, expected, monkeypatch, capsys):
    assert expected in one_line_exit_2(BASE + extra, 1, monkeypatch, capsys)


def test_train_samples_give_whole_iterations():
    args = parses(BASE + ["--train-samples", "44"], world_size=1)
    assert (args.train_iters, args.lr_decay_samples) == (5, 44)  # the partial last batch is dropped, as upstream


# ------------------------------------------------------------------------------------- the schedule itself
def upstream_lr(style, n, warmup, decay, max_lr=1e-3, min_lr=1e-4):
    """Upstream's learning rate (optimizer_param_scheduler.py, get_lr) at position n of a schedule that
    warms up over `warmup` and decays over `decay` (all in one unit)."""
    if warmup > 0 and n <= warmup:
        return max_lr * n / warmup
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    ratio = (n - warmup) / (decay - warmup)
    coefficient = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coefficient * (max_lr - min_lr)


def drive(args, iterations):
    """The learning rate and weight decay each iteration trains with, stepping the scheduler as DeepSpeed
    does (step() after each optimizer step), with the token count the training loop keeps."""
    optimizer = torch.optim.AdamW(get_param_groups(torch.nn.Linear(2, 2)), lr=args.lr)
    consumed = {"tokens": 0}
    scheduler = OptimizerParamScheduler.from_args(optimizer, args, consumed_tokens=lambda: consumed["tokens"])
    used = []
    for _ in range(iterations):
        used.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"],
                     optimizer.param_groups[1]["weight_decay"]))
        scheduler.step()
        consumed["tokens"] += args.global_batch_size * args.seq_length
    return used, scheduler


STYLES = ["constant", "linear", "cosine", "inverse-square-root"]
# unit -> (flags with a 2-iteration warm-up and a 10-iteration decay in that unit, position of iteration i
# in that unit, warm-up, decay). Samples advance 8 per iteration; upstream's scheduler sees the tokens
# consumed before the previous iteration (none for the first two).
UNITS = {
    "iters": (["--train-iters", "12", "--lr-warmup-iters", "2", "--lr-decay-iters", "10"],
              lambda i: (i - 1) * 8, 16, 80),
    "samples": (["--train-samples", "96", "--lr-warmup-samples", "16", "--lr-decay-samples", "80"],
                lambda i: (i - 1) * 8, 16, 80),
    "fraction": (["--train-iters", "12", "--lr-decay-iters", "10", "--lr-warmup-fraction", "0.2"],
                 lambda i: (i - 1) * 8, 0.2 * 80, 80),
    "tokens": (["--train-iters", "12", "--lr-warmup-tokens", str(2 * TOKENS), "--lr-decay-tokens", str(10 * TOKENS)],
               lambda i: max(i - 2, 0) * TOKENS, 2 * TOKENS, 10 * TOKENS),
}


@pytest.mark.parametrize("unit", sorted(UNITS))
@pytest.mark.parametrize("style", STYLES)
def test_learning_rate_follows_upstream(style, unit):
    flags, position, warmup, decay = UNITS[unit]
    args = parses(BASE + flags + ["--lr-decay-style", style], world_size=1)
    used, _ = drive(args, 13)
    for iteration, (lr, _, _) in enumerate(used, start=1):
        assert lr == pytest.approx(upstream_lr(style, position(iteration), warmup, decay), rel=1e-12, abs=1e-18), \
            (style, unit, iteration)


def test_learning_rate_literal_values():
    """Linear, warm-up 2 iterations, decay 10: 0, lr/2, lr, then down by (lr - min_lr)/8 per iteration."""
    args = parses(BASE + ["--train-iters", "12", "--lr-warmup-iters", "2", "--lr-decay-iters", "10"], world_size=1)
    lrs = [lr for lr, _, _ in drive(args, 12)[0]]
    assert lrs[:5] == pytest.approx([0.0, 5e-4, 1e-3, 8.875e-4, 7.75e-4], rel=1e-12)
    assert lrs[10:] == pytest.approx([1e-4, 1e-4], rel=1e-12)  # at and past the end of the decay: min-lr


def test_sample_warmup_with_token_decay():
    """Upstream records the tokens seen when the sample warm-up ends and decays from there."""
    args = parses(BASE + ["--train-iters", "12", "--lr-warmup-iters", "2", "--lr-decay-tokens", str(10 * TOKENS),
                          "--lr-decay-style", "linear"], world_size=1)
    used, scheduler = drive(args, 6)
    lrs = [lr for lr, _, _ in used]
    warm_end_tokens = TOKENS  # the step after iteration 2 reads the tokens before iteration 2
    assert scheduler.lr_warmup_tokens == warm_end_tokens
    assert lrs[:3] == pytest.approx([0.0, 5e-4, 1e-3], rel=1e-12)
    for iteration in (4, 5, 6):
        tokens = (iteration - 2) * TOKENS
        ratio = (tokens - warm_end_tokens) / (10 * TOKENS - warm_end_tokens)
        assert lrs[iteration - 1] == pytest.approx(1e-4 + (1 - ratio) * 9e-4, rel=1e-12)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_weight_decay_increment_follows_upstream(style):
    flags = ["--train-iters", "10", "--weight-decay-incr-style", style]
    flags += ["--start-weight-decay", "0.01", "--end-weight-decay", "0.1"] if style != "constant" else []
    used, _ = drive(parses(BASE + flags, world_size=1), 12)
    for iteration, (_, wd, no_decay_wd) in enumerate(used, start=1):
        ratio = min((iteration - 1) * 8 / 80, 1.0)
        expected = {"constant": 0.01, "linear": 0.01 + ratio * 0.09,
                    "cosine": 0.01 + 0.5 * (math.cos(math.pi * (1 - ratio)) + 1) * 0.09}[style]
        if (iteration - 1) * 8 > 80:
            expected = 0.1 if style != "constant" else 0.01
        assert wd == pytest.approx(expected, rel=1e-12) and no_decay_wd == 0.0, (style, iteration)


UPSTREAM_STATE_KEYS = {"max_lr", "lr_warmup_steps", "lr_warmup_tokens", "num_steps", "num_tokens", "lr_decay_style",
                       "lr_decay_steps", "lr_decay_tokens", "min_lr", "start_wd", "end_wd", "wd_incr_style",
                       "wd_incr_steps"}


def test_state_dict_has_upstream_keys_and_resumes_the_schedule():
    args = parses(BASE + ["--train-iters", "12", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine"], world_size=1)
    full, first = drive(args, 12)
    _, half = drive(args, 5)
    state = half.state_dict()
    assert set(state) == UPSTREAM_STATE_KEYS and state["num_steps"] == 5 * 8
    optimizer = torch.optim.AdamW(get_param_groups(torch.nn.Linear(2, 2)), lr=1.0)
    resumed = OptimizerParamScheduler.from_args(optimizer, args, consumed_tokens=lambda: 0)
    resumed.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == full[5][0]  # iteration 6's learning rate, bit for bit


CONSTANT_AFTER_WARMUP = ["--train-iters", "12", "--lr-warmup-iters", "2", "--lr-decay-style", "constant"]


def schedule_state(**changes):
    args = parses(BASE + CONSTANT_AFTER_WARMUP, world_size=1)
    state = drive(args, 3)[1].state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize("flag,expected_lr", [(None, None), ("--override-opt_param-scheduler", 1e-3),
                                              ("--use-checkpoint-opt_param-scheduler", 2e-3)])
def test_checkpoint_scheduler_values_against_the_flags(flag, expected_lr):
    """The checkpoint says max_lr 2e-3, the flags 1e-3: a mismatch stops the run unless one flag decides."""
    state = schedule_state(max_lr=2e-3)
    args = parses(BASE + CONSTANT_AFTER_WARMUP + ([flag] if flag else []), world_size=1)
    scheduler = OptimizerParamScheduler.from_args(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), args,
                                                  consumed_tokens=lambda: 0)
    if flag is None:
        with pytest.raises(SchedulerStateMismatch, match="learning rate 0.002, the flags give 0.001"):
            scheduler.load_state_dict(state)
        return
    scheduler.load_state_dict(state)
    assert scheduler.max_lr == expected_lr and scheduler.num_steps == 24
    assert scheduler.optimizer.param_groups[0]["lr"] == expected_lr  # step 24 is past the warm-up of 16


# ------------------------------------------------------------------------------------- precision, ZeRO
def deepspeed_config(tmp_path, config):
    (tmp_path / "ds.json").write_text(json.dumps(config))
    return ["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")]


def test_fp16_flags_without_deepspeed_get_upstream_defaults():
    args = parses(BASE + ["--train-iters", "5", "--fp16"], world_size=1)
    assert args.deepspeed_config_dict["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 32,
                                                  "min_loss_scale": 1.0, "loss_scale_window": 1000, "hysteresis": 2}


def test_fp16_flags_fill_the_config_which_wins_on_conflict(tmp_path):
    config = {"fp16": {"enabled": True, "loss_scale_window": 500}}
    extra = ["--train-iters", "5", "--fp16", "--loss-scale-window", "200", "--initial-loss-scale", "4096",
             "--hysteresis", "3", "--loss-scale", "64"]
    args = parses(BASE + extra + deepspeed_config(tmp_path, config), world_size=1)
    assert args.deepspeed_config_dict["fp16"] == {"enabled": True, "loss_scale_window": 500, "loss_scale": 64.0,
                                                  "initial_scale_power": 12, "hysteresis": 3}
    assert args.start_up_notes == ["> the DeepSpeed config's fp16 section wins over the flags: loss_scale_window 500 "
                                   "(not --loss-scale-window 200)"]


def test_zero_stage_flag_overrides_the_config(tmp_path):
    args = parses(BASE + ["--train-iters", "5", "--zero-stage", "0"]
                  + deepspeed_config(tmp_path, {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}}),
                  world_size=1)
    assert args.zero_stage == 0
    assert args.deepspeed_config_dict["zero_optimization"] == {"stage": 0, "reduce_bucket_size": 1000}
    assert args.start_up_notes == ["> --zero-stage 0 overrides the DeepSpeed config's zero_optimization.stage 1"]


def test_sgd_under_zero_needs_the_config_to_allow_it(tmp_path, monkeypatch, capsys):
    line = one_line_exit_2(BASE + ["--train-iters", "5", "--optimizer", "sgd", "--zero-stage", "1"], 1, monkeypatch,
                           capsys)
    assert "--optimizer sgd under ZeRO stage 1" in line
    parses(BASE + ["--train-iters", "5", "--optimizer", "sgd", "--zero-stage", "1"]
           + deepspeed_config(tmp_path, {"zero_allow_untested_optimizer": True}), world_size=1)


def test_machine_checks_name_the_flag():
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    args = parses(BASE + ["--train-iters", "5", "--distributed-backend", "nccl"], world_size=1)
    if accelerator.device_name() == "cuda":
        check_machine_supports(args)
    else:
        with pytest.raises(ArgumentError, match="--distributed-backend nccl is not available on this machine"):
            check_machine_supports(args)
    args = parses(BASE + ["--train-iters", "5", "--fp16"], world_size=1)
    if accelerator.is_fp16_supported():
        check_machine_supports(args)
    else:
        with pytest.raises(ArgumentError, match="--fp16: DeepSpeed's .* accelerator on this machine has no float16"):
            check_machine_supports(args)


def test_exit_interval():
    args = parses(BASE + ["--train-iters", "12", "--exit-interval", "4"], world_size=1)
    assert [iteration for iteration in range(1, 13) if _exit_reason(args, iteration)] == [4, 8, 12]
    assert _exit_reason(args, 8) == "at iteration 8 (--exit-interval 4)"


# ------------------------------------------------------------------------------------- the log line
def test_log_line_fields_in_upstream_order():
    args = parses(BASE + ["--train-iters", "5"], world_size=1)
    args.padded_vocab_size = 256
    line = TrainingLogLine(iteration=3, train_iters=5, consumed_samples=24, consumed_tokens=384,
                           seconds_per_iteration=0.5, learning_rate=1e-3, global_batch_size=8, lm_loss=5.25,
                           loss_scale=2048.0, grad_norm=1.5, params_norm=12.0, actual_seqlen=16, skipped_iterations=1,
                           nan_iterations=0, rates=throughput(args, 0.5, upstream_flops_per_iteration(args)),
                           num_zeros=7.0).format()
    names = [part.strip().rsplit(":", 1)[0] for part in line.strip().rstrip("|").split(" | ")]
    assert names[0].startswith("iteration") and names[1:] == list(FIELD_ORDER[1:])
    assert line.startswith(" iteration        3/       5 | consumed samples:           24 | consumed tokens:"
                           "          384 | elapsed time per iteration (ms): 500.0 | learning rate: 1.000E-03 |"
                           " global batch size:     8 | lm loss: 5.250000E+00 | loss scale: 2048.0 | grad norm: 1.500 |"
                           " num zeros: 7.0 |"
                           " params norm: 12.000 | actual seqlen:    16 | number of skipped iterations:   1 |"
                           " number of nan iterations:   0 | samples per second: 16.000 |"
                           " tokens per gpu per second (tgs): 256.000 | TFLOPs: ")


def test_throughput_by_upstream_convention():
    """TFLOPs: the whole global batch's FLOPs over seconds per iteration times the world size."""
    args = parses(BASE + ["--train-iters", "5", "--tensor-model-parallel-size", "2", "--global-batch-size", "32"],
                  world_size=4)  # data-parallel 2
    args.padded_vocab_size = 256
    rates = throughput(args, 0.25, upstream_flops_per_iteration(args))
    assert rates.tflops == upstream_flops_per_iteration(args) / (0.25 * 4) / 1e12
    assert rates.samples_per_second == 32 / 0.25
    assert rates.tokens_per_gpu_per_second == 32 / 0.25 * 16 / 4


def test_interval_stats_count_skipped_and_nan_iterations():
    stats = IntervalStats()
    for loss, skipped in ((4.0, False), (float("inf"), True), (2.0, False), (3.0, True)):
        stats.add(loss, skipped)
    assert (stats.advanced, stats.skipped, stats.nan, stats.iterations) == (2, 2, 1, 4)
    assert stats.mean_loss == 3.0  # skipped iterations' losses are left out, as upstream
    assert IntervalStats().mean_loss is None



# ------------------------------------------------------------------------------------- upstream's whole flag list
UPSTREAM_FLAG_LIST = REPO / "tests" / "data" / "upstream_argument_flags.txt"


def upstream_flag_list():
    lines = UPSTREAM_FLAG_LIST.read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def sample_value(action):
    """A value of the flag's type, to give a valued flag (invalid values must fail in one line too)."""
    if action.choices:
        return str(list(action.choices)[0])
    if action.default not in (None, True, False) and not isinstance(action.default, list):
        return str(action.default)
    if action.type is float:
        return "0.5"
    return "1" if action.type is int else "x"


def test_every_upstream_flag_is_known_and_never_unrecognized(gpt_125m, monkeypatch, capsys):
    """Each of upstream's flags, given alone on top of the 125M script: it parses (a no-op one is named in
    the start-up note) or stops with one line and exit 2 naming it; never "unrecognized arguments"."""
    from megatron import upstream_flags

    flags = upstream_flag_list()
    assert len(flags) > 300
    known = build_parser()._option_string_actions
    refused_by_name = set(upstream_flags.UNSUPPORTED_FLAGS) | set(upstream_flags._DEPRECATED)
    assert sorted(flag for flag in flags if flag not in known and flag not in refused_by_name) == []
    no_ops = {flag: entry.flags[0] for entry in NO_OPS for flag in entry.flags}  # an alias: the note's name
    outcomes = {}
    for flag in flags:
        if flag in ("--local-rank", "--local_rank"):
            continue  # the launcher's own
        argv = list(gpt_125m)
        if flag in known:
            action = known[flag]
            argv += [flag] if action.nargs == 0 else [flag, sample_value(action)]
        else:
            argv += [flag, "1"]
        try:
            args = parses(argv)
        except SystemExit as error:
            lines = capsys.readouterr().err.splitlines()
            assert error.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (flag, lines)
            assert "unrecognized arguments" not in lines[0], flag
            outcomes[flag] = "refused"
            if flag in refused_by_name:
                assert lines[0].startswith(f"error: {flag}"), (flag, lines)
            continue
        outcomes[flag] = "parsed"
        if flag in no_ops:
            assert any(f"{no_ops[flag]} (" in note for note in args.start_up_notes), flag
    assert set(flag for flag, outcome in outcomes.items() if outcome == "refused") >= \
        refused_by_name & set(flags)


# ------------------------------------------------------------------------------------- honest meanings
def test_activation_checkpointing_section_and_flags_reach_deepspeed(tmp_path, gpt_125m, monkeypatch, capsys):
    """The config's activation_checkpointing section decides; a given flag turns its option on (tp 2 here)."""
    from megatron.arguments import ActivationCheckpointing

    config = json.loads(gpt_125m_ds_config(tmp_path / "c.json").read_text())
    config["activation_checkpointing"] = {"partition_activations": True, "profile": True}
    (tmp_path / "ac.json").write_text(json.dumps(config))
    argv = list(gpt_125m)
    argv[argv.index("--deepspeed_config") + 1] = str(tmp_path / "ac.json")
    args = parses(argv + ["--synchronize-each-layer"])
    assert args.activation_checkpointing == ActivationCheckpointing(
        partition_activations=True, contiguous_checkpointing=False, checkpoint_in_cpu=False, synchronize=True,
        profile=True)
    assert parses(gpt_125m).activation_checkpointing == ActivationCheckpointing(False, False, False, False, False)
    line = one_line_exit_2(gpt_125m + ["--contigious-checkpointing"], WORLD, monkeypatch, capsys)
    assert line.startswith("error: contiguous activation checkpointing (--contigious-checkpointing) needs "
                           "partitioned activations")


def test_partitioned_activations_at_tp1_say_they_split_nothing(gpt_125m):
    argv = list(gpt_125m)
    argv[argv.index("--tensor-model-parallel-size") + 1] = "1"
    args = parses(argv + ["--partition-activations"], world_size=2)
    assert args.activation_checkpointing.partition_activations
    assert "> partitioned activations: tensor-parallel size 1, so there is nothing to split; each rank keeps " \
           "its whole checkpointed activations" in args.start_up_notes


def test_checkpoint_and_data_flags(tmp_path, gpt_125m, monkeypatch, capsys):
    args = parses(without_flags(gpt_125m, ["--save"]) + ["--save-interval", "7"])  # upstream: nothing is saved
    assert (args.save, args.save_interval) == (None, 7)
    args = parses(gpt_125m + ["--no-save-rng", "--no-load-rng", "--finetune", "--dataloader-type", "single",
                              "--rotary-position-embeddings-theta", "500000", "--no-position-embedding"])
    assert (args.no_save_rng, args.no_load_rng, args.finetune, args.rope_theta, args.add_position_embedding) == (
        True, True, True, 500000, False)
    line = one_line_exit_2(gpt_125m + ["--dataloader-type", "cyclic"], WORLD, monkeypatch, capsys)
    assert line.startswith("error: --dataloader-type cyclic: a data loader reshuffling every epoch")
    line = one_line_exit_2(gpt_125m + ["--load", tmp_path, "--load-tag", "global_step9"], WORLD, monkeypatch, capsys)
    assert line == f"error: --load-tag global_step9: no such checkpoint in {tmp_path}"


def test_deepscale_config_is_the_deepspeed_config(gpt_125m):
    argv = list(gpt_125m)
    argv[argv.index("--deepspeed_config")] = "--deepscale_config"
    args = parses(argv)
    assert args.deepspeed_config == gpt_125m[gpt_125m.index("--deepspeed_config") + 1]
    assert args.deepspeed_config_dict == parses(gpt_125m).deepspeed_config_dict


def test_checkpoint_without_rng_state_needs_no_load_rng(tmp_path, gpt_125m, monkeypatch, capsys):
    """As upstream: a checkpoint saved with --no-save-rng resumes only with --no-load-rng (said at start)."""
    from argparse import Namespace

    (tmp_path / "global_step5").mkdir()
    torch.save({"args": Namespace(), "iteration": 5}, tmp_path / "global_step5" / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step5")
    line = one_line_exit_2(gpt_125m + ["--load", tmp_path], WORLD, monkeypatch, capsys)
    assert line == (f"error: --load {tmp_path}: checkpoint global_step5 holds no RNG state (saved with "
                    f"--no-save-rng): give --no-load-rng to resume without it")
    assert parses(gpt_125m + ["--load", tmp_path, "--no-load-rng"]).no_load_rng


def test_model_type_unpickles_at_upstreams_path():
    """Upstream pickles args.model_type by reference: module megatron.core.enums, class ModelType, member name."""
    import pickle

    from megatron.core.enums import ModelType

    assert {member.name: member.value for member in ModelType} == {
        "encoder_or_decoder": 1, "encoder_and_decoder": 2, "retro_encoder": 3, "retro_decoder": 4}
    data = pickle.dumps(ModelType.encoder_or_decoder, protocol=2)
    assert b"megatron.core.enums" in data and b"ModelType" in data
    assert pickle.loads(data) is ModelType.encoder_or_decoder
    assert parses(BASE + ["--train-iters", "5"], world_size=1).model_type is ModelType.encoder_or_decoder
