"""Command-line arguments with Megatron-DeepSpeed's flag names and defaults, and the checks that stop a run early.

Every check here runs before torch.distributed is touched: a bad combination of flags ends every
rank with one line naming the problem and exit code 2, so no rank can be left waiting in a
collective that another rank never enters. Upstream flags for features this fork does not have are
refused the same way (megatron/upstream_flags.py); kernel switches that change nothing here are
accepted and listed once in the log.
"""
import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass

import deepspeed

from megatron import upstream_flags
from megatron.core.enums import ModelType
from megatron.optimizer_param_scheduler import LR_DECAY_STYLES, WD_INCR_STYLES
from megatron.tokenizer.tokenizer import TOKENIZER_TYPES, tokenizer_files_problem
from patches.process.errors import EXIT_BAD_INPUT, PatchConfigError, exit_with_one_line
from patches.to_megatron.megatron_flags import add_profiler_flags, take_profiler_flags

EXIT_BAD_ARGS = EXIT_BAD_INPUT
DEFAULT_PARTITION_METHOD = "type:ParallelTransformerLayerPipe"


class ArgumentError(PatchConfigError):
    """A flag, or a combination of flags, that cannot work."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage on error; we print one line, as for every other bad input."""

    def error(self, message):
        raise ArgumentError(message)


def exit_on_bad_args(message):
    """Print one line (on the first rank only, to avoid N copies) and exit 2 on every rank."""
    exit_with_one_line(message)


@dataclass(frozen=True)
class ActivationCheckpointingOption:
    flag: str
    config_key: str  # in the DeepSpeed config's activation_checkpointing section
    help: str


# In the order of deepspeed.checkpointing.configure's keywords (ActivationCheckpointing's fields).
ACTIVATION_CHECKPOINTING_OPTIONS = (
    ActivationCheckpointingOption("--partition-activations", "partition_activations",
                                  "split each checkpointed activation over the tensor-parallel ranks"),
    ActivationCheckpointingOption("--contigious-checkpointing", "contiguous_memory_optimization",
                                  "copy partitioned checkpoints into one buffer (needs --partition-activations)"),
    ActivationCheckpointingOption("--checkpoint-in-cpu", "cpu_checkpointing",
                                  "keep partitioned checkpoints in CPU memory (needs --partition-activations)"),
    ActivationCheckpointingOption("--synchronize-each-layer", "synchronize_checkpoint_boundary",
                                  "synchronize the accelerator around each checkpointed chunk"),
    ActivationCheckpointingOption("--profile-backward", "profile",
                                  "DeepSpeed logs the time of each checkpointed chunk's forward and backward"),
)


def build_parser(extra_args_provider=None):
    parser = _OneLineParser(description="Megatron-style GPT pre-training on DeepSpeed", allow_abbrev=False)
    _add_model_args(parser)
    _add_recompute_args(parser)
    _add_precision_args(parser)
    _add_batch_args(parser)
    _add_distributed_args(parser)
    _add_regularization_args(parser)
    _add_learning_rate_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)
    _add_deepspeed_args(parser)
    _add_profiler_args(parser)
    upstream_flags.add_no_op_args(parser)
    upstream_flags.add_unsupported_args(parser)
    parser = deepspeed.add_config_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def _add_model_args(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default: 4 x hidden size; with --swiglu 2/3 of that, rounded down to a multiple of 64")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--kv-channels", type=int, default=None,
                   help="head size; default: hidden size / attention heads")
    g.add_argument("--num-key-value-heads", type=int, default=None,
                   help="key/value heads, grouped-query attention (1: multi-query); default: attention heads")
    g.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLP: the first projection outputs 2 x ffn size, silu(first half) x second half")
    g.add_argument("--normalization", default="layernorm", choices=["layernorm", "rmsnorm"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="rotary position embeddings on queries and keys, no learned position table")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's channels that is rotated")
    g.add_argument("--rotary-position-embeddings-theta", type=int, default=10000, dest="rope_theta",
                   help="the rotary frequencies' base")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="no learned position table (with rotary embeddings there is none anyway)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate LM head instead of the word embedding's transpose")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no biases in the attention and MLP linears")
    # Upstream's default is on; a numerical identity here (see ParallelAttention), kept for its flags.
    g.add_argument("--apply-query-key-layer-scaling", action="store_true", dest="apply_query_key_layer_scaling",
                   default=True, help="scale attention scores by 1 / layer number, undone in the softmax")
    g.add_argument("--no-query-key-layer-scaling", action="store_false", dest="apply_query_key_layer_scaling")


def _add_recompute_args(parser):
    g = parser.add_argument_group("activation recompute")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each chunk of --checkpoint-num-layers transformer layers in backward "
                        "(= --recompute-granularity full --recompute-method uniform)")
    g.add_argument("--checkpoint-num-layers", type=int, default=1)
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="full: whole transformer layers; selective: the attention core softmax(Q K^T) V only")
    g.add_argument("--recompute-method", "--activations-checkpoint-method", dest="recompute_method", default=None,
                   choices=["uniform", "block"],
                   help="with full: uniform, chunks of --recompute-num-layers layers; block, only the first "
                        "--recompute-num-layers layers of each pipeline stage, one by one")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recomputed chunk (default: --checkpoint-num-layers)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="= --recompute-granularity selective")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="recompute through deepspeed.checkpointing (always the case here)")
    # deepspeed.checkpointing's options. Given, a flag overrides the DeepSpeed config's
    # activation_checkpointing section; absent, the section decides (upstream passes False instead).
    for option in ACTIVATION_CHECKPOINTING_OPTIONS:
        g.add_argument(option.flag, action="store_true", help=option.help)


def _add_precision_args(parser):
    g = parser.add_argument_group("mixed precision (mapped onto the DeepSpeed config's fp16/bf16 sections)")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    # Without --deepspeed these default to upstream's own loss scaler's values (FP16_DEFAULTS); with
    # --deepspeed, as upstream, only flags given explicitly reach the config, and DeepSpeed's defaults
    # fill the rest. A key the config sets itself always wins (the log says so).
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale (a power of 2); default: dynamic loss scaling")
    g.add_argument("--initial-loss-scale", type=float, default=None,
                   help="initial dynamic loss scale, a power of 2 (upstream's default 2**32)")
    g.add_argument("--min-loss-scale", type=float, default=None, help="minimum dynamic loss scale (default 1)")
    g.add_argument("--loss-scale-window", type=float, default=None,
                   help="iterations without overflow before the dynamic scale grows (default 1000)")
    g.add_argument("--hysteresis", type=int, default=None,
                   help="overflows tolerated before the dynamic scale shrinks (default 2)")


# Upstream's own loss scaler's defaults (megatron/arguments.py: _add_mixed_precision_args).
FP16_DEFAULTS = {"loss_scale": None, "initial_loss_scale": 2.0 ** 32, "min_loss_scale": 1.0,
                 "loss_scale_window": 1000.0, "hysteresis": 2}


def _add_batch_args(parser):
    g = parser.add_argument_group("batch size")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data-parallel size")


def _add_distributed_args(parser):
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="train the plain GPTModel with a DeepSpeedEngine instead of a PipelineEngine")
    g.add_argument("--pp-partition-method", default=DEFAULT_PARTITION_METHOD,
                   help="how DeepSpeed cuts the layers into stages: 'uniform' (same number of layers), "
                        "'parameters' (balance their parameter counts) or 'type:REGEX' (balance the layers whose "
                        "class matches; 'type:transformer|embedding' also weighs the embedding and the LM head, as "
                        "in Megatron-DeepSpeed); --pp-partition-from-profile cuts where a profiled run says")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo", "ccl", "hccl"],
                   help="default: the accelerator's own (gloo on CPU, nccl on CUDA); upstream's default is nccl")
    g.add_argument("--distributed-timeout-minutes", type=int, default=None,
                   help="timeout of torch.distributed's collectives (default 10, or MEGATRON_DIST_TIMEOUT_S seconds)")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the launcher")


def _add_regularization_args(parser):
    g = parser.add_argument_group("optimizer and regularization")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"], help="adam is AdamW, as upstream")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="weight decay at the start, with --weight-decay-incr-style linear or cosine")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="weight decay at the end, with --weight-decay-incr-style linear or cosine")
    g.add_argument("--weight-decay-incr-style", default="constant", choices=list(WD_INCR_STYLES))
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip by the global L2 norm (0 disables); the DeepSpeed config's gradient_clipping wins")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)


def _add_learning_rate_args(parser):
    g = parser.add_argument_group("learning rate (megatron/optimizer_param_scheduler.py)")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--lr-decay-style", default="linear", choices=list(LR_DECAY_STYLES))
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default: --train-samples")
    g.add_argument("--lr-decay-tokens", type=int, default=None,
                   help="decay over this many tokens instead (overrides the iteration/sample span)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm up over this fraction of the decay span")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-tokens", type=int, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, take the schedule from the flags, not from the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, take the schedule from the checkpoint, not from the flags")


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=None, help="give this or --train-samples")
    g.add_argument("--train-samples", type=int, default=None, help="give this or --train-iters")
    g.add_argument("--train-tokens", type=int, default=None, help="also stop once this many tokens are consumed")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit after an iteration divisible by this")
    g.add_argument("--exit-duration-in-mins", type=int, default=None,
                   help="save (with --save) and exit once training has run this many minutes")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="a prefix, or weight prefix pairs; without it a synthetic source is used")
    g.add_argument("--data-cache-path", default=None,
                   help="the directory for the sample index files (default: beside the data)")
    g.add_argument("--dataloader-type", default=None, choices=["single", "cyclic"],
                   help="single, upstream's default, is this fork's loader; cyclic is not supported")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--data-impl", default="infer", choices=["mmap", "infer"],
                   help="indexed dataset format: mmap, or infer it from the .idx header (only mmap exists here)")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes per rank (0: read in-line)")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=list(TOKENIZER_TYPES))
    g.add_argument("--tokenizer-model", default=None, help="the SentencePiece model of GPTSentencePieceTokenizer")
    g.add_argument("--synthetic-vocab-size", type=int, default=1024,
                   help="vocabulary of the synthetic source used when no --data-path is given")


def _add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None, help="without --save nothing is saved, as upstream")
    g.add_argument("--no-save-rng", action="store_true",
                   help="save no RNG state (resuming such a checkpoint then needs --no-load-rng, as upstream)")
    g.add_argument("--no-load-rng", action="store_true",
                   help="resume without the checkpoint's RNG state: the generators keep this run's seeds")
    g.add_argument("--no-load-optim", action="store_true",
                   help="with DeepSpeed (as upstream) the optimizer state is loaded anyway, except from a pipeline "
                        "checkpoint of other parts (--pp-partition-from-profile), where it is then left out")
    g.add_argument("--load-tag", default=None,
                   help="the checkpoint in --load to resume (global_step<N>), instead of the one `latest` names")
    g.add_argument("--finetune", action="store_true",
                   help="load the weights only: start at iteration 0 with a fresh optimizer, scheduler and RNG")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="pending TensorBoard events before a write to disk")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write the iteration time (the only timer measured here)")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--no-log-learnig-rate-to-tensorboard", action="store_false",
                   dest="log_learning_rate_to_tensorboard", help="upstream's spelling")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false", dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-optimizer-states-to-tensorboard", action="store_true",
                   help="norms and largest magnitudes of Adam's moments and of the weights")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-params-norm", action="store_true", help="the parameters' global L2 norm in the log line")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="the number of zero gradient elements in the log line (fp32 without ZeRO only)")
    g.add_argument("--loss-record-file", default=None,
                   help="append each iteration's exact loss as a JSON line (written by the last rank)")


def _add_deepspeed_args(parser):
    g = parser.add_argument_group("ZeRO (--deepspeed and --deepspeed_config come from DeepSpeed)")
    g.add_argument("--zero-stage", type=int, default=None,
                   help="overrides the DeepSpeed config's zero_optimization.stage (default: the config's, else 0)")


def _add_profiler_args(parser):
    g = add_profiler_flags(parser)  # --profile-flops-step, --profile-flops-output, --profile-flops-counting
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak TFLOPS, for MFU when the device is not in the table")


def parse_args(argv=None, extra_args_provider=None, defaults=None, world_size=None):
    """Parse and validate; returns args, or exits 2 with one line on any bad input."""
    parser = build_parser(extra_args_provider)
    if defaults:
        parser.set_defaults(**defaults)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        # Upstream flags of features this fork lacks: named before argparse could call them unknown.
        # (argparse has no public list of its option strings.)
        refused = upstream_flags.refused_on_command_line(argv, lambda flag: flag in parser._option_string_actions)
        _require(refused is None, refused)
        args = parser.parse_args(argv)
        validate_args(args, world_size)
    except ArgumentError as error:
        exit_on_bad_args(str(error))
    return args


def validate_args(args, world_size):
    """Fill derived values and reject combinations that cannot work (raises ArgumentError)."""
    args.world_size = world_size
    args.rank = int(os.environ.get("RANK", "0"))
    # Lines for the log once distributed is up (rank 0 prints them): what the flags changed or did not.
    args.start_up_notes = []
    refused = upstream_flags.refused_option_value(args)
    _require(refused is None, refused)
    no_ops = upstream_flags.given_no_ops(args)
    if no_ops:
        args.start_up_notes.append("> accepted, no effect here: " + "; ".join(no_ops))
    _validate_distributed(args, world_size)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size

    _validate_model(args, tp)
    _validate_recompute(args)
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 cannot both be set")

    _validate_batch(args)
    _validate_schedule(args)
    _validate_optimizer(args)
    _validate_logging(args)
    _validate_load(args)
    _validate_data(args)
    _validate_profiler(args)
    _validate_partition(args, pp)  # after the profiler's flags: the memory limit a profile's plan is made under
    args.deepspeed_config_dict = _build_deepspeed_config(args)
    # Training progress, as upstream starts it here (a checkpoint's values replace it on --load).
    args.consumed_train_samples, args.consumed_train_tokens = 0, 0
    # Upstream's pretrain() sets it; checkpoints pickle it (megatron/core/enums.py says why it exists here).
    args.model_type = ModelType.encoder_or_decoder
    return args


def _validate_distributed(args, world_size):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(tp >= 1 and pp >= 1, "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    if args.no_pipeline_parallel:
        _require(pp == 1, f"--no-pipeline-parallel needs --pipeline-model-parallel-size 1, got {pp}")
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) parallel size")
    args.data_parallel_size = world_size // (tp * pp)
    if args.distributed_timeout_minutes is not None:
        _require(args.distributed_timeout_minutes >= 1, "--distributed-timeout-minutes must be >= 1")


def _validate_model(args, tp):
    """The model's shape: sizes that divide, defaults derived from the other sizes."""
    _require(args.num_layers >= 1 and args.hidden_size >= 1, "--num-layers and --hidden-size must be >= 1")
    heads = args.num_attention_heads
    _require(heads >= 1, "--num-attention-heads must be >= 1")
    _require(heads % tp == 0, f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.kv_channels is None:
        _require(args.hidden_size % heads == 0,
                 f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads} "
                 f"(or give --kv-channels)")
        args.kv_channels = args.hidden_size // heads
    _require(args.kv_channels >= 1, "--kv-channels must be >= 1")
    if args.num_key_value_heads is None:
        args.num_key_value_heads = heads
    kv_heads = args.num_key_value_heads
    _require(1 <= kv_heads <= heads and heads % kv_heads == 0,
             f"--num-key-value-heads {kv_heads} must divide --num-attention-heads {heads}")
    # Each tensor rank holds whole key/value heads with the query heads that read them (as upstream).
    _require(kv_heads % tp == 0, f"--num-key-value-heads {kv_heads} cannot be split over "
                                 f"--tensor-model-parallel-size {tp}: each tensor rank needs whole key/value heads")
    if args.use_rotary_position_embeddings:
        _require(0.0 < args.rotary_percent <= 1.0, "--rotary-percent must be in (0, 1]")
        rotary_dim = int(args.kv_channels * args.rotary_percent)
        _require(rotary_dim >= 2 and rotary_dim % 2 == 0,
                 f"--rotary-percent {args.rotary_percent:g} of head size {args.kv_channels} gives {rotary_dim} "
                 f"rotated channels; rotary embeddings need an even number >= 2")
    if args.ffn_hidden_size is None and args.swiglu:
        # Upstream's default: SwiGLU's two input projections at about the parameters of a 4h MLP, 2/3 x 4h,
        # rounded down to a multiple of 64.
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64
        _require(args.ffn_hidden_size >= 1, f"--swiglu's default MLP size, 2/3 x 4 x --hidden-size {args.hidden_size} "
                                            f"rounded down to a multiple of 64, is 0: give --ffn-hidden-size")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    _require(args.ffn_hidden_size >= 1, "--ffn-hidden-size must be >= 1")
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")


def _validate_recompute(args):
    """Upstream's recompute flags mapped onto --checkpoint-activations / --checkpoint-num-layers.

    After this, checkpoint_activations says whether whole layers are recomputed (chunks of
    checkpoint_num_layers) and recompute_granularity is None, 'full' or 'selective'.
    """
    _require(args.checkpoint_num_layers >= 1, "--checkpoint-num-layers must be >= 1")
    if args.recompute_activations:
        _require(args.recompute_granularity in (None, "selective"),
                 "--recompute-activations means --recompute-granularity selective, not "
                 f"{args.recompute_granularity}")
        args.recompute_granularity = "selective"
    if args.checkpoint_activations:
        _require(args.recompute_granularity in (None, "full"),
                 f"--checkpoint-activations recomputes full layers; it contradicts --recompute-granularity "
                 f"{args.recompute_granularity}")
        args.recompute_granularity = "full"
    if args.recompute_num_layers is not None:
        _require(args.recompute_num_layers >= 1, "--recompute-num-layers must be >= 1")
        _require(args.recompute_granularity == "full",
                 "--recompute-num-layers needs --recompute-granularity full")
        args.checkpoint_num_layers = args.recompute_num_layers
    if args.recompute_method is not None:
        _require(args.recompute_granularity == "full", "--recompute-method needs --recompute-granularity full")
    elif args.recompute_granularity == "full":
        args.recompute_method = "uniform"
    args.checkpoint_activations = args.recompute_granularity == "full"
    args.recompute_num_layers = args.checkpoint_num_layers


def _validate_partition(args, pp):
    """Every stage must get at least one of the layers the partition method weighs; a partition report must be of
    this model."""
    method = args.pp_partition_method
    if args.pp_partition_from_profile is not None:
        _require(not args.no_pipeline_parallel, "--pp-partition-from-profile cuts a pipeline's layers: "
                                                "--no-pipeline-parallel builds none")
        _require(method == DEFAULT_PARTITION_METHOD, f"--pp-partition-from-profile and --pp-partition-method "
                                                     f"{method!r} both choose the partition: give one")
        from megatron.model.gpt_model import stage_boundaries

        try:
            stage_boundaries(args, pp)
        except PatchConfigError as error:
            raise ArgumentError(f"--pp-partition-from-profile: {error}") from None
        return
    if method not in ("uniform", "parameters"):
        _require(method.startswith("type:") and len(method) > len("type:"),
                 f"--pp-partition-method {method!r}: expected 'uniform', 'parameters' or 'type:REGEX' "
                 f"(e.g. 'type:transformer|embedding')")
        try:
            re.compile(method[len("type:"):])
        except re.error as error:
            message = f"--pp-partition-method {method!r} is not a valid regular expression: {error}"
            raise ArgumentError(message) from None
    if method == "parameters":  # every layer has parameters; their counts need the vocabulary, not known yet
        _require(pp <= args.num_layers + 3, f"--pipeline-model-parallel-size {pp} exceeds the model's "
                                            f"{args.num_layers + 3} layers: a stage would hold none")
        return
    if method == DEFAULT_PARTITION_METHOD:
        _require(pp <= args.num_layers, f"--pipeline-model-parallel-size {pp} exceeds --num-layers "
                                        f"{args.num_layers}: a stage would hold no layer")
    from megatron.model.gpt_model import stage_boundaries

    boundaries, weights = stage_boundaries(args, pp)
    _require(sum(weights) >= pp, f"--pipeline-model-parallel-size {pp} exceeds the {sum(weights)} layers "
                                 f"--pp-partition-method {method} weighs: a stage would hold none")
    for stage in range(pp):
        _require(sum(weights[boundaries[stage]:boundaries[stage + 1]]) > 0,
                 f"--pp-partition-method {method} leaves pipeline stage {stage} of {pp} without a layer it weighs")


def _validate_batch(args):
    micro, dp = args.micro_batch_size, args.data_parallel_size
    _require(micro >= 1, "--micro-batch-size must be >= 1")
    if args.global_batch_size is None:
        args.global_batch_size = micro * dp
    _require(args.global_batch_size % (micro * dp) == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by "
             f"--micro-batch-size {micro} x data-parallel size {dp}")
    args.num_micro_batches = args.global_batch_size // (micro * dp)


def _validate_schedule(args):
    """Upstream's rules: iteration- or sample-based training, and warm-up/decay spans in that unit (or tokens)."""
    _require((args.train_iters is None) != (args.train_samples is None),
             "give exactly one of --train-iters and --train-samples")
    if args.train_samples is None:
        _require(args.train_iters >= 1, "--train-iters must be >= 1")
        for flag, value in (("--lr-decay-samples", args.lr_decay_samples), ("--lr-warmup-samples",
                                                                            args.lr_warmup_samples or None)):
            _require(value is None, f"{flag} needs sample-based training (--train-samples); "
                                    f"with --train-iters use {flag.replace('samples', 'iters')}")
        _require(args.lr_warmup_fraction is None or args.lr_warmup_iters == 0,
                 "give only one of --lr-warmup-fraction and --lr-warmup-iters")
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
    else:
        _require(args.train_samples >= 1, "--train-samples must be >= 1")
        for flag, value in (("--lr-decay-iters", args.lr_decay_iters), ("--lr-warmup-iters",
                                                                        args.lr_warmup_iters or None)):
            _require(value is None, f"{flag} needs iteration-based training (--train-iters); "
                                    f"with --train-samples use {flag.replace('iters', 'samples')}")
        _require(args.lr_warmup_fraction is None or args.lr_warmup_samples == 0,
                 "give only one of --lr-warmup-fraction and --lr-warmup-samples")
        # As upstream: whole global batches only, a partial last batch is dropped.
        args.train_iters = args.train_samples // args.global_batch_size
        _require(args.train_iters >= 1, f"--train-samples {args.train_samples} is less than one global batch "
                                        f"({args.global_batch_size} samples)")
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
    for flag in ("--train-tokens", "--lr-decay-iters", "--lr-decay-samples", "--lr-decay-tokens"):
        value = getattr(args, _dest(flag))
        _require(value is None or value >= 1, f"{flag} must be >= 1")
    for flag in ("--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-tokens"):
        value = getattr(args, _dest(flag))
        _require(value is None or value >= 0, f"{flag} must be >= 0")
    if args.lr_warmup_fraction is not None:
        _require(0.0 <= args.lr_warmup_fraction < 1.0, "--lr-warmup-fraction must be in [0, 1)")
    _require(0.0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    # Upstream also asserts that the warm-up ends before the decay span; here a warm-up as long as the
    # run is allowed (short test runs): the learning rate then goes to --min-lr when the warm-up ends.
    _require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
             "give only one of --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler")
    _validate_weight_decay_schedule(args)
    for flag in ("--exit-interval", "--exit-duration-in-mins"):
        value = getattr(args, _dest(flag))
        _require(value is None or value >= (1 if flag == "--exit-interval" else 0), f"{flag} must be positive")
    _require(args.log_interval >= 1, "--log-interval must be >= 1")
    _require(args.eval_interval >= 1, "--eval-interval must be >= 1")
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0")
    if args.save_interval is not None:
        _require(args.save_interval >= 1, "--save-interval must be >= 1")


def _validate_weight_decay_schedule(args):
    if args.weight_decay_incr_style == "constant":
        for flag in ("--start-weight-decay", "--end-weight-decay"):
            _require(getattr(args, _dest(flag)) is None,
                     f"{flag} needs --weight-decay-incr-style linear or cosine (constant uses --weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    else:
        _require(args.start_weight_decay is not None and args.end_weight_decay is not None,
                 f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
                 f"--end-weight-decay")
    _require(0.0 <= args.start_weight_decay <= args.end_weight_decay,
             "weight decay must be >= 0 and may only grow (--start-weight-decay <= --end-weight-decay)")


def _validate_optimizer(args):
    _require(args.weight_decay >= 0.0, "--weight-decay must be >= 0")
    _require(args.clip_grad >= 0.0, "--clip-grad must be >= 0 (0 disables clipping)")
    if args.optimizer == "adam":
        _require(0.0 <= args.adam_beta1 < 1.0 and 0.0 <= args.adam_beta2 < 1.0,
                 "--adam-beta1 and --adam-beta2 must be in [0, 1)")
        _require(args.adam_eps > 0.0, "--adam-eps must be > 0")
    else:
        _require(args.sgd_momentum >= 0.0, "--sgd-momentum must be >= 0")


def _validate_logging(args):
    _require(args.tensorboard_log_interval >= 1, "--tensorboard-log-interval must be >= 1")
    _require(args.tensorboard_queue_size >= 1, "--tensorboard-queue-size must be >= 1")


def _dest(flag):
    return flag.lstrip("-").replace("-", "_")


def _validate_load(args):
    if args.load:
        from megatron.checkpointing import (
            LATEST_FILE,
            CheckpointError,
            check_checkpoint_args,
            has_rng_state,
            read_latest_tag,
            saved_client_state,
        )

        if args.load_tag is not None:
            tag = args.load_tag
            _require(os.path.isdir(os.path.join(args.load, tag)),
                     f"--load-tag {tag}: no such checkpoint in {args.load}")
        else:
            tag = read_latest_tag(args.load)
            _require(tag is None or os.path.isdir(os.path.join(args.load, tag)),
                     f"--load {args.load}: {LATEST_FILE} names checkpoint {tag}, which is not there")
        if tag is not None:
            try:
                state = saved_client_state(args.load, tag)
                if state is not None and state.get("args") is not None:
                    check_checkpoint_args(state["args"], args)
            except CheckpointError as error:
                raise ArgumentError(f"--load {args.load}: {error}") from None
            _require(state is None or args.no_load_rng or args.finetune or has_rng_state(state),
                     f"--load {args.load}: checkpoint {tag} holds no RNG state (saved with --no-save-rng): "
                     f"give --no-load-rng to resume without it")


def _validate_data(args):
    _require(args.num_workers >= 0, "--num-workers must be >= 0")
    _require(args.dataloader_type != "cyclic",
             "--dataloader-type cyclic: a data loader reshuffling every epoch is not supported here "
             "(single, upstream's default, is)")
    if args.data_path:
        problem = tokenizer_files_problem(args)
        _require(problem is None, f"--data-path: {problem}")
        try:
            split = [float(x) for x in args.split.replace("/", ",").split(",")]
        except ValueError:
            raise ArgumentError(f"--split {args.split!r} is not a list of numbers like 969,30,1") from None
        _require(sum(split) > 0 and all(x >= 0 for x in split), f"--split {args.split!r} needs non-negative weights")
        _check_indexed_datasets(args.data_path)


def _check_indexed_datasets(data_path):
    """Open every prefix's .idx/.bin now: a corrupt file must stop every rank before any collective."""
    from megatron.data.dataset_utils import parse_blend
    from megatron.data.indexed_dataset import IndexFileError, MMapIndexedDataset

    try:
        prefixes = data_path if len(data_path) == 1 else parse_blend(data_path)[0]
    except ValueError as error:
        raise ArgumentError(f"--data-path: {error}") from None
    for prefix in prefixes:
        try:
            MMapIndexedDataset(prefix)
        except IndexFileError as error:
            raise ArgumentError(str(error)) from None


def _validate_profiler(args):
    """The profiler's flags, checked; --pp-partition-memory-limit: every plan of this process (the cut a profile
    report asks for, the profile report's own plan) is made under it."""
    try:
        take_profiler_flags(args, on_deepspeeds_pipeline=not args.no_pipeline_parallel)
    except PatchConfigError as error:
        raise ArgumentError(str(error)) from None
    step = args.profile_flops_step
    if step is not None:
        if args.train_tokens is not None:
            last = -(-args.train_tokens // (args.global_batch_size * args.seq_length))
            _require(step <= last, f"--profile-flops-step {step} would never run: --train-tokens {args.train_tokens} "
                                   f"is reached at iteration {last}")
        if args.load:
            from megatron.checkpointing import latest_iteration

            resumed = None if args.finetune else latest_iteration(args.load, args.load_tag)
            _require(resumed is None or step > resumed,
                     f"--profile-flops-step {step} would never run: the checkpoint in --load {args.load} is at "
                     f"iteration {resumed}, so training resumes at iteration {(resumed or 0) + 1}")
    if args.peak_tflops is not None:
        _require(args.peak_tflops > 0, "--peak-tflops must be > 0")


def _build_deepspeed_config(args):
    """The DeepSpeed config as a dict: the user's file, checked against the flags and completed by them."""
    config = {}
    if args.deepscale_config:  # DeepSpeed's old name for --deepspeed_config
        _require(args.deepspeed_config in (None, args.deepscale_config),
                 f"--deepscale_config {args.deepscale_config} and --deepspeed_config {args.deepspeed_config} "
                 f"name different files")
        args.deepspeed_config = args.deepscale_config
    if args.deepspeed_config:
        try:
            with open(args.deepspeed_config) as f:
                config = json.load(f)
        except OSError as error:
            raise ArgumentError(f"cannot read --deepspeed_config {args.deepspeed_config}: {error.strerror}") from None
        except json.JSONDecodeError as error:
            raise ArgumentError(f"--deepspeed_config {args.deepspeed_config} is not valid JSON: {error}") from None
    _require(isinstance(config, dict), f"--deepspeed_config {args.deepspeed_config} must hold a JSON object")
    refused = upstream_flags.refused_config_section(config)
    _require(refused is None, refused)
    micro, gas, dp = args.micro_batch_size, args.num_micro_batches, args.data_parallel_size
    expected = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": args.global_batch_size,
    }
    for key, value in expected.items():
        if key in config and config[key] != value:
            raise ArgumentError(
                f"DeepSpeed config {key}={config[key]} contradicts the flags (which give {value}: "
                f"micro batch {micro} x micro-batches {gas} x data-parallel {dp})")
        config[key] = value
    config.setdefault("steps_per_print", 10**9)  # Megatron prints its own log lines
    for flag, key in (("fp16", "fp16"), ("bf16", "bf16")):
        section = config.get(key, {})
        if getattr(args, flag):
            section = dict(section, enabled=True)
        if section:
            config[key] = section
    args.fp16 = bool(config.get("fp16", {}).get("enabled", False))
    args.bf16 = bool(config.get("bf16", {}).get("enabled", False))
    _require(not (args.fp16 and args.bf16), "the DeepSpeed config enables both fp16 and bf16")
    if args.fp16:
        _map_loss_scaling(args, config["fp16"])
    _map_gradient_clipping(args, config)
    _map_zero_stage(args, config)
    args.activation_checkpointing = _activation_checkpointing(args, config)
    _require(not args.log_num_zeros_in_grad or not (args.fp16 or args.bf16 or args.zero_stage > 0),
             "--log-num-zeros-in-grad: with fp16, bf16 or ZeRO the gradients are in DeepSpeed's own buffers, "
             "where this fork does not count them")
    if args.optimizer == "sgd" and args.zero_stage > 0:
        _require(config.get("zero_allow_untested_optimizer", False),
                 f"--optimizer sgd under ZeRO stage {args.zero_stage}: DeepSpeed's ZeRO optimizer refuses SGD unless "
                 f"the DeepSpeed config sets \"zero_allow_untested_optimizer\": true")
    _validate_flops_profiler_section(config.get("flops_profiler"))
    return config


@dataclass(frozen=True)
class ActivationCheckpointing:
    """deepspeed.checkpointing.configure's options (the field names are its keywords)."""
    partition_activations: bool
    contiguous_checkpointing: bool
    checkpoint_in_cpu: bool
    synchronize: bool
    profile: bool


def _activation_checkpointing(args, config):
    """A given flag turns its option on; otherwise the config's activation_checkpointing section decides."""
    section = config.get("activation_checkpointing", {})
    _require(isinstance(section, dict), "DeepSpeed config activation_checkpointing must be an object")
    settings = ActivationCheckpointing(*(getattr(args, _dest(option.flag)) or bool(section.get(option.config_key))
                                         for option in ACTIVATION_CHECKPOINTING_OPTIONS))
    _require(settings.partition_activations or not settings.contiguous_checkpointing,
             "contiguous activation checkpointing (--contigious-checkpointing) needs partitioned activations "
             "(--partition-activations), as DeepSpeed's")
    if settings.partition_activations and args.tensor_model_parallel_size == 1:
        args.start_up_notes.append("> partitioned activations: tensor-parallel size 1, so there is nothing to "
                                   "split; each rank keeps its whole checkpointed activations")
    return settings


# Megatron's loss-scaling flags and the DeepSpeed fp16 keys they set.
_LOSS_SCALING_KEYS = {"loss_scale": "loss_scale", "initial_loss_scale": "initial_scale_power",
                      "min_loss_scale": "min_loss_scale", "loss_scale_window": "loss_scale_window",
                      "hysteresis": "hysteresis"}


def _loss_scaling_value(name, value):
    """A loss-scaling flag's value in DeepSpeed's terms (a static scale of 0 means dynamic)."""
    flag = "--" + name.replace("_", "-")
    if name == "loss_scale":
        _require(value is None or value > 0, f"{flag} must be > 0")
        return 0 if value is None else value
    if name == "initial_loss_scale":
        power = math.log2(value) if value > 0 else -1.0
        _require(power >= 0 and power == int(power), f"{flag} {value:g} is not a power of 2 (DeepSpeed takes "
                                                     f"initial_scale_power)")
        return int(power)
    if name == "loss_scale_window":
        _require(value >= 1 and value == int(value), f"{flag} must be a whole number >= 1")
        return int(value)
    _require(value >= (1 if name == "hysteresis" else 0), f"{flag} must be positive")
    return value


def _map_loss_scaling(args, section):
    """Fill the fp16 section from the loss-scaling flags; a key the config sets wins (one log line)."""
    ignored = []
    for name, key in _LOSS_SCALING_KEYS.items():
        given = getattr(args, name)
        if given is None and args.deepspeed:
            continue  # upstream under DeepSpeed: the config and DeepSpeed's defaults decide
        value = _loss_scaling_value(name, FP16_DEFAULTS[name] if given is None else given)
        if key not in section:
            section[key] = value
        elif given is not None and section[key] != value:
            ignored.append(f"{key} {section[key]} (not --{name.replace('_', '-')} {given:g})")
    if ignored:
        args.start_up_notes.append("> the DeepSpeed config's fp16 section wins over the flags: " + ", ".join(ignored))


def _map_gradient_clipping(args, config):
    # Clipping happens in our optimizer (megatron/optimizer.py), by the true global norm; DeepSpeed's
    # own fp32 clipping miscounts under a pipeline. Its fp16/bf16 and ZeRO optimizers still clip
    # themselves: they wrap ours and hand it flat partitions, whose norm it cannot take.
    if "gradient_clipping" in config and config["gradient_clipping"] != args.clip_grad:
        args.start_up_notes.append(f"> the DeepSpeed config's gradient_clipping {config['gradient_clipping']} wins "
                                   f"over --clip-grad {args.clip_grad:g}")
    args.clip_grad = config.get("gradient_clipping", args.clip_grad)
    zero = config.get("zero_optimization", {}).get("stage", 0) if args.zero_stage is None else args.zero_stage
    if args.fp16 or args.bf16 or zero > 0:
        config["gradient_clipping"] = args.clip_grad
        args.clip_grad = 0.0
    else:
        config["gradient_clipping"] = 0.0


def _map_zero_stage(args, config):
    section = config.setdefault("zero_optimization", {})
    _require(isinstance(section, dict), "DeepSpeed config zero_optimization must be an object")
    if args.zero_stage is not None:
        if "stage" in section and section["stage"] != args.zero_stage:
            args.start_up_notes.append(f"> --zero-stage {args.zero_stage} overrides the DeepSpeed config's "
                                       f"zero_optimization.stage {section['stage']}")
        section["stage"] = args.zero_stage
    args.zero_stage = section.setdefault("stage", 0)
    _require(args.zero_stage in (0, 1, 2, 3), f"ZeRO stage {args.zero_stage}: must be 0, 1, 2 or 3")
    _require(args.zero_stage <= 1 or args.no_pipeline_parallel,
             f"ZeRO stage {args.zero_stage} cannot shard a pipeline's gradients: use stage 0 or 1 "
             f"(or --no-pipeline-parallel)")


# Keys and types of DeepSpeed's flops_profiler section (docs: deepspeed.ai/docs/config-json).
FLOPS_PROFILER_KEYS = {
    "enabled": bool, "recompute_fwd_factor": (int, float), "profile_step": int, "module_depth": int,
    "top_modules": int, "detailed": bool, "output_file": (str, type(None)),
}


def _validate_flops_profiler_section(section):
    if section is None:
        return
    _require(isinstance(section, dict), "DeepSpeed config flops_profiler must be an object")
    for key, value in section.items():
        _require(key in FLOPS_PROFILER_KEYS,
                 f"DeepSpeed config flops_profiler has unknown key {key!r} "
                 f"(known: {', '.join(sorted(FLOPS_PROFILER_KEYS))})")
        expected = FLOPS_PROFILER_KEYS[key]
        wrong_bool = isinstance(value, bool) and expected is not bool and bool not in (
            expected if isinstance(expected, tuple) else (expected,))
        _require(isinstance(value, expected) and not wrong_bool,
                 f"DeepSpeed config flops_profiler.{key} has the wrong type: {type(value).__name__}")
    if "profile_step" in section:
        _require(section["profile_step"] >= 1, "DeepSpeed config flops_profiler.profile_step must be >= 1")
    output_file = section.get("output_file")
    if output_file:
        parent = os.path.dirname(os.path.abspath(output_file))
        _require(not os.path.isdir(output_file) and os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK),
                 f"DeepSpeed config flops_profiler.output_file {output_file} cannot be written "
                 f"(is it a directory, or is {parent} missing or read-only?)")


def _require(condition, message):
    if not condition:
        raise ArgumentError(message)
