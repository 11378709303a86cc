"""Megatron-DeepSpeed's own launch scripts as argument lists, sizes shrunk, flags exactly as they spell them.

- gpt_125m_args: examples_deepspeed/rebase/ds_pretrain_gpt_125M.sh (the 1.3B, 13B, flash-attention
  and RoPE scripts of rebase/ differ from it only in sizes and a flag or two, listed in REBASE_VARIANTS),
  with its DeepSpeed config from ds_config_gpt_TEMPLATE.json (gpt_125m_ds_config).
- megatron_gpt_args: examples/pretrain_gpt.sh, Megatron-LM's own (no DeepSpeed flags).
- llama2_args: examples_deepspeed/pretrain_llama2_distributed.sh (pretrain_llama_distributed.sh is the
  same less --num-key-value-heads).
- UNSUPPORTED: flags of upstream scripts for features this fork does not have, each with the value a
  script passes; appended to a list, each must stop the run with one line.
"""
import json
from pathlib import Path

# Model and data as the 125M script sets them, shrunk: pipeline 2 x tensor 2 (as the script), ZeRO 1.
GPT_125M = {"num_layers": 4, "hidden_size": 64, "num_attn_heads": 4, "seq_len": 32, "global_batch_size": 8,
            "batch_size": 2, "lr": "6.0e-4", "min_lr": "1.0e-6", "init_std": "0.02", "mp_size": 2, "pp_size": 2,
            "zero_stage": 1, "log_interval": 1, "eval_iters": 1, "eval_interval": 100, "save_interval": 100,
            "seed": 1234, "num_workers": 0, "exit_duration": 30000000}
# Iterations the shrunk run trains: the script stops on --train-tokens and sets --train-samples "large enough".
GPT_125M_ITERATIONS = 3
GPT_125M_TRAIN_SAMPLES = 5 * GPT_125M["global_batch_size"]


def gpt_125m_tokens_per_iteration():
    return GPT_125M["global_batch_size"] * GPT_125M["seq_len"]


def gpt_125m_ds_config(path, precision="fp16"):
    """ds_config_gpt_TEMPLATE.json with the script's substitutions; precision "bf16" swaps its fp16
    section for a bf16 one (CPUs without float16 support)."""
    config = {
        "train_batch_size": GPT_125M["global_batch_size"],
        "train_micro_batch_size_per_gpu": GPT_125M["batch_size"],
        "steps_per_print": GPT_125M["log_interval"],
        "zero_optimization": {"stage": GPT_125M["zero_stage"]},
        "gradient_clipping": 1.0,
        "prescale_gradients": GPT_125M["zero_stage"] == 0,  # the script: "false" once ZeRO is on
        "wall_clock_breakdown": False,
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                          "min_loss_scale": 1, "initial_scale_power": 11}
    else:
        config["bf16"] = {"enabled": True}
    Path(path).write_text(json.dumps(config, indent=2))
    return Path(path)


def gpt_125m_args(data_path, vocab_path, merge_path, config_json, checkpoint_path, tensorboard_path,
                  precision="fp16"):
    """The script's megatron_options, data_options and deepspeed_options, in its order (activation
    checkpointing and optimizer-state logging on, as it ships)."""
    c = GPT_125M
    tokens = gpt_125m_tokens_per_iteration()
    megatron_options = [
        "--override-opt_param-scheduler",
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.95",
        "--tensor-model-parallel-size", c["mp_size"],
        "--init-method-std", c["init_std"],
        "--lr-decay-tokens", GPT_125M_ITERATIONS * tokens,
        "--lr-warmup-tokens", tokens,
        "--micro-batch-size", c["batch_size"],
        "--exit-duration-in-mins", c["exit_duration"],
        "--global-batch-size", c["global_batch_size"],
        "--num-layers", c["num_layers"],
        "--hidden-size", c["hidden_size"],
        "--num-attention-heads", c["num_attn_heads"],
        "--seq-length", c["seq_len"],
        "--max-position-embeddings", c["seq_len"],
        "--train-tokens", GPT_125M_ITERATIONS * tokens,
        "--train-samples", GPT_125M_TRAIN_SAMPLES,
        "--lr", c["lr"],
        "--min-lr", c["min_lr"],
        "--lr-decay-style", "cosine",
        "--split", "949,50,1",
        "--log-interval", c["log_interval"],
        "--eval-interval", c["eval_interval"],
        "--eval-iters", c["eval_iters"],
        "--save-interval", c["save_interval"],
        "--weight-decay", "0.1",
        "--clip-grad", "1.0",
        "--hysteresis", "2",
        "--num-workers", c["num_workers"],
        "--fp16" if precision == "fp16" else "--bf16",
        "--seed", c["seed"],
        "--load", checkpoint_path,
        "--save", checkpoint_path,
        "--no-async-tensor-model-parallel-allreduce",
        "--tensorboard-queue-size", "1",
        "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--tensorboard-dir", tensorboard_path,
        "--checkpoint-activations",
        "--log-optimizer-states-to-tensorboard",
    ]
    data_options = ["--vocab-file", vocab_path, "--merge-file", merge_path, "--data-path", data_path,
                    "--data-impl", "mmap"]
    deepspeed_options = ["--deepspeed", "--deepspeed_config", config_json, "--zero-stage", c["zero_stage"],
                         "--pipeline-model-parallel-size", c["pp_size"], "--deepspeed-activation-checkpointing"]
    return [str(a) for a in megatron_options + data_options + deepspeed_options]


# What the other rebase/ scripts add to (or use instead of) the 125M script's flags.
REBASE_VARIANTS = {
    "ds_pretrain_gpt_125M_flashattn.sh": ["--use-flash-attn"],
    "ds_pretrain_gpt_1.3B_rope.sh": ["--use-rotary-position-embeddings", "--rotary-percent", "0.25"],
    # this one also drops --deepspeed, --deepspeed_config, --zero-stage and --deepspeed-activation-checkpointing
    # and recomputes by these flags instead of --checkpoint-activations
    "ds_pretrain_gpt_1.3B_megatron_checkpointing.sh": ["--recompute-granularity", "full", "--recompute-method",
                                                       "uniform", "--recompute-num-layers", "1"],
    'any rebase script with no_pp="true" (and pp_size=1)': ["--no-pipeline-parallel"],
}

def megatron_gpt_args(data_path, vocab_file, merge_file, checkpoint_path):
    """examples/pretrain_gpt.sh (and pretrain_gpt_distributed.sh, which adds --distributed-backend nccl):
    $GPT_ARGS $DATA_ARGS $OUTPUT_ARGS --save --load, sizes shrunk; iteration-based with a warm-up fraction."""
    args = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--lr", "0.00015", "--train-iters", "500", "--lr-decay-iters", "320", "--lr-decay-style", "cosine",
        "--min-lr", "1.0e-5", "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01", "--clip-grad", "1.0",
        "--fp16",
        "--data-path", data_path, "--vocab-file", vocab_file, "--merge-file", merge_file, "--data-impl", "mmap",
        "--split", "949,50,1",
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
        "--save", checkpoint_path, "--load", checkpoint_path,
    ]
    return [str(a) for a in args]


# The LLaMA-2 script's sizes, shrunk (GQA kept: 4 heads over 2 key-value heads).
LLAMA2 = {"TP": 2, "PP": 2, "ZERO_STAGE": 0, "HIDDEN_SIZE": 64, "FFN_HIDDEN_SIZE": 172, "NUM_LAYERS": 4,
          "NUM_HEADS": 4, "SEQ_LENGTH": 32, "NUM_KV_HEADS": 2, "MICRO_BATCH_SIZE": 2, "GLOBAL_BATCH_SIZE": 8,
          "TRAIN_STEPS": 3, "LR": "3e-4", "MIN_LR": "3e-5", "LR_WARMUP_STEPS": 1, "WEIGHT_DECAY": "0.1",
          "GRAD_CLIP": 1}


def llama2_ds_config(path):
    """The config the script writes with its heredoc."""
    c = LLAMA2
    config = {"train_batch_size": c["GLOBAL_BATCH_SIZE"], "train_micro_batch_size_per_gpu": c["MICRO_BATCH_SIZE"],
              "steps_per_print": 1, "zero_optimization": {"stage": c["ZERO_STAGE"]}, "bf16": {"enabled": True}}
    Path(path).write_text(json.dumps(config, indent=2))
    return Path(path)


def llama2_args(data_path, tokenizer_model, checkpoint_path, ds_config, backend="nccl"):
    """The script's torchrun arguments after pretrain_gpt.py, then $ds_args (activation checkpointing
    off, as it ships). Its --distributed-backend is nccl; CPU runs pass backend="gloo"."""
    c = LLAMA2
    args = [
        "--tensor-model-parallel-size", c["TP"],
        "--pipeline-model-parallel-size", c["PP"],
        "--num-layers", c["NUM_LAYERS"],
        "--hidden-size", c["HIDDEN_SIZE"],
        "--ffn-hidden-size", c["FFN_HIDDEN_SIZE"],
        "--num-attention-heads", c["NUM_HEADS"],
        "--micro-batch-size", c["MICRO_BATCH_SIZE"],
        "--global-batch-size", c["GLOBAL_BATCH_SIZE"],
        "--seq-length", c["SEQ_LENGTH"],
        "--max-position-embeddings", c["SEQ_LENGTH"],
        "--train-iters", c["TRAIN_STEPS"],
        "--save", checkpoint_path,
        "--load", checkpoint_path,
        "--data-path", "1", data_path,
        "--data-impl", "mmap",
        "--tokenizer-type", "GPTSentencePieceTokenizer",
        "--tokenizer-model", tokenizer_model,
        "--split", "949,50,1",
        "--distributed-backend", backend,
        "--lr", c["LR"],
        "--lr-decay-style", "cosine",
        "--min-lr", c["MIN_LR"],
        "--weight-decay", c["WEIGHT_DECAY"],
        "--clip-grad", c["GRAD_CLIP"],
        "--lr-warmup-iters", c["LR_WARMUP_STEPS"],
        "--optimizer", "adam",
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.95",
        "--log-interval", "1",
        "--save-interval", "10000",
        "--eval-interval", "1000",
        "--eval-iters", "10",
        "--bf16",
        "--no-query-key-layer-scaling",
        "--attention-dropout", "0",
        "--hidden-dropout", "0",
        "--use-rotary-position-embeddings",
        "--untie-embeddings-and-output-weights",
        "--swiglu",
        "--normalization", "rmsnorm",
        "--disable-bias-linear",
        "--num-key-value-heads", c["NUM_KV_HEADS"],
        # $ds_args, built back to front by the script
        f"--zero-stage={c['ZERO_STAGE']}",
        f"--deepspeed_config={ds_config}",
        "--deepspeed",
    ]
    return [str(a) for a in args]


# Flags of upstream scripts this fork refuses, with the values the scripts pass, and a word of the
# one-line refusal. The scripts: examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh (--num-experts),
# examples/pretrain_gpt_distributed_with_mp.sh (--sequence-parallel),
# sequence_parallel/ds_pretrain_gpt_1.3B_seq_parallel_32k.sh (--ds-sequence-parallel-size),
# examples/pretrain_gpt3_175B.sh (--rampup-batch-size), data_efficiency/gpt/pretrain/*_base_script.sh
# (--random-ltd, --data-efficiency-curriculum-learning), pretrain_llama2_distributed.sh with LOG_TO_WANDB=1
# (--wandb-project), compression/ds_pretrain_gpt_1.3B_dense_cl_kd.sh (--kd), examples/sc21/run_figure_12.sh
# (--num-layers-per-virtual-pipeline-stage).
UNSUPPORTED = [
    (["--num-experts", "4"], "mixture of experts (MoE)"),
    (["--sequence-parallel"], "Megatron-LM sequence parallelism"),
    (["--ds-sequence-parallel-size", "2"], "DeepSpeed sequence parallelism"),
    (["--rampup-batch-size", "16", "16", "5859375"], "batch-size ramp-up"),
    (["--random-ltd"], "random layer token drop"),
    (["--data-efficiency-curriculum-learning"], "curriculum learning"),
    (["--wandb-project", "pretrain-llama2"], "Weights & Biases"),
    (["--kd"], "knowledge distillation"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "interleaved pipeline"),
]
# "Off" values of refused features: accepted.
UNSUPPORTED_AT_OFF_VALUE = [["--num-experts", "1"], ["--ds-sequence-parallel-size", "1"], ["--mlp-type", "standard"],
                            ["--topk", "1"]]

def flag_names(argv):
    """The option names of an argument list (`--name=value` counts as --name)."""
    return [token.split("=", 1)[0] for token in argv if token.startswith("--")]


def without_flags(argv, flags):
    """argv less the given flags and their values (a flag's values run up to the next --option)."""
    kept, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token.split("=", 1)[0] in flags
        if not skipping:
            kept.append(token)
    return kept
