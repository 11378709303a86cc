"""Command-line arguments with Megatron-LM's flag names, and the checks that stop a run early.

Every check here runs before torch.distributed is touched: a bad combination of flags ends every
rank with one line naming the problem and exit code 2, so no rank can be left waiting in a
collective that another rank never enters.
"""
import argparse
import json
import os
import re
import sys

import deepspeed

EXIT_BAD_ARGS = 2
DEFAULT_PARTITION_METHOD = "type:ParallelTransformerLayerPipe"


class ArgumentError(ValueError):
    """A flag, or a combination of flags, that cannot work."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage on error; we print one line, as for every other bad input."""

    def error(self, message):
        raise ArgumentError(message)


def exit_on_bad_args(message):
    """Print one line (on the first rank only, to avoid N copies) and exit 2 on every rank."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_ARGS)


def build_parser(extra_args_provider=None):
    parser = _OneLineParser(description="Megatron-style GPT pre-training on DeepSpeed", allow_abbrev=False)
    _add_model_args(parser)
    _add_recompute_args(parser)
    _add_precision_args(parser)
    _add_batch_and_parallel_args(parser)
    _add_optimizer_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)
    _add_profiler_args(parser)
    parser = deepspeed.add_config_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def _add_model_args(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)


def _add_recompute_args(parser):
    g = parser.add_argument_group("activation recompute")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each chunk of --checkpoint-num-layers transformer layers in backward")
    g.add_argument("--checkpoint-num-layers", type=int, default=1)


def _add_precision_args(parser):
    g = parser.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")


def _add_batch_and_parallel_args(parser):
    g = parser.add_argument_group("batch and parallelism")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data-parallel size")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="train the plain GPTModel with a DeepSpeedEngine instead of a PipelineEngine")
    g.add_argument("--pp-partition-method", default=DEFAULT_PARTITION_METHOD,
                   help="how DeepSpeed cuts the layers into stages: 'uniform' (same number of layers) or "
                        "'type:REGEX' (balance the layers whose class matches; 'type:transformer|embedding' "
                        "also weighs the embedding and the LM head, as in Megatron-DeepSpeed)")
    g.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl"],
                   help="default: the accelerator's own (gloo on CPU, nccl on CUDA)")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the launcher")


def _add_optimizer_args(parser):
    g = parser.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--seed", type=int, default=1234)


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="a prefix, or weight prefix pairs; without it a synthetic source is used")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=["GPT2BPETokenizer"])
    g.add_argument("--synthetic-vocab-size", type=int, default=1024,
                   help="vocabulary of the synthetic source used when no --data-path is given")


def _add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--loss-record-file", default=None,
                   help="append each iteration's exact loss as a JSON line (written by the last rank)")


def _add_profiler_args(parser):
    g = parser.add_argument_group("FLOPs profiler")
    g.add_argument("--profile-flops-step", type=_positive_int_flag, default=None,
                   help="profile this iteration on every pipeline stage and print one gathered report")
    g.add_argument("--profile-flops-output", default=".",
                   help="directory for flops_profile_step{N}.json (default: working directory)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak TFLOPS, for MFU when the device is not in the table")


def _positive_int_flag(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_args(argv=None, extra_args_provider=None, defaults=None, world_size=None):
    """Parse and validate; returns args, or exits 2 with one line on any bad input."""
    parser = build_parser(extra_args_provider)
    if defaults:
        parser.set_defaults(**defaults)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = parser.parse_args(argv)
        validate_args(args, world_size)
    except ArgumentError as error:
        exit_on_bad_args(str(error))
    return args


def validate_args(args, world_size):
    """Fill derived values and reject combinations that cannot work (raises ArgumentError)."""
    args.world_size = world_size
    args.rank = int(os.environ.get("RANK", "0"))
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(tp >= 1 and pp >= 1, "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    if args.no_pipeline_parallel:
        _require(pp == 1, f"--no-pipeline-parallel needs --pipeline-model-parallel-size 1, got {pp}")
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) parallel size")
    args.data_parallel_size = world_size // (tp * pp)

    _validate_model(args, tp)
    _validate_partition(args, pp)
    _validate_recompute(args)
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 cannot both be set")

    _validate_batch(args)
    _validate_schedule(args)
    _validate_load(args)
    _validate_data(args)
    _validate_profiler(args)
    args.deepspeed_config_dict = _build_deepspeed_config(args)
    return args


def _validate_model(args, tp):
    """The model's shape: sizes that divide, defaults derived from the other sizes."""
    _require(args.num_layers >= 1 and args.hidden_size >= 1, "--num-layers and --hidden-size must be >= 1")
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    _require(args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")


def _validate_recompute(args):
    _require(args.checkpoint_num_layers >= 1, "--checkpoint-num-layers must be >= 1")


def _validate_partition(args, pp):
    """Every stage must get at least one of the layers the partition method weighs."""
    method = args.pp_partition_method
    if method != "uniform":
        _require(method.startswith("type:") and len(method) > len("type:"),
                 f"--pp-partition-method {method!r}: expected 'uniform' or 'type:REGEX' "
                 f"(e.g. 'type:transformer|embedding')")
        try:
            re.compile(method[len("type:"):])
        except re.error as error:
            raise ArgumentError(f"--pp-partition-method {method!r} is not a valid regular expression: {error}")
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
    _require(args.train_iters >= 1, "--train-iters must be >= 1")
    _require(args.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _require(args.log_interval >= 1, "--log-interval must be >= 1")
    _require(args.eval_interval >= 1, "--eval-interval must be >= 1")
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0")
    if args.save_interval is not None:
        _require(args.save_interval >= 1, "--save-interval must be >= 1")
        _require(args.save is not None, "--save-interval needs --save DIR")


def _validate_load(args):
    if args.load:
        from megatron.checkpointing import LATEST_FILE, read_latest_tag

        tag = read_latest_tag(args.load)
        _require(tag is None or os.path.isdir(os.path.join(args.load, tag)),
                 f"--load {args.load}: {LATEST_FILE} names checkpoint {tag}, which is not there")


def _validate_data(args):
    if args.data_path:
        _require(args.vocab_file and args.merge_file, "--data-path needs --vocab-file and --merge-file")
        for path in (args.vocab_file, args.merge_file):
            _require(os.path.isfile(path), f"tokenizer file not found: {path}")
        try:
            split = [float(x) for x in args.split.replace("/", ",").split(",")]
        except ValueError:
            raise ArgumentError(f"--split {args.split!r} is not a list of numbers like 969,30,1")
        _require(sum(split) > 0 and all(x >= 0 for x in split), f"--split {args.split!r} needs non-negative weights")
        _check_indexed_datasets(args.data_path)


def _check_indexed_datasets(data_path):
    """Open every prefix's .idx/.bin now: a corrupt file must stop every rank before any collective."""
    from megatron.data.dataset_utils import parse_blend
    from megatron.data.indexed_dataset import IndexFileError, MMapIndexedDataset

    try:
        prefixes = data_path if len(data_path) == 1 else parse_blend(data_path)[0]
    except ValueError as error:
        raise ArgumentError(f"--data-path: {error}")
    for prefix in prefixes:
        try:
            MMapIndexedDataset(prefix)
        except IndexFileError as error:
            raise ArgumentError(str(error))


def _validate_profiler(args):
    step = args.profile_flops_step
    if step is not None:
        _require(step <= args.train_iters,
                 f"--profile-flops-step {step} is beyond --train-iters {args.train_iters}")
        out = args.profile_flops_output
        _require(_writable_dir(out), f"--profile-flops-output {out} is not a writable directory")
        if args.load:
            from megatron.checkpointing import latest_iteration

            resumed = latest_iteration(args.load)
            _require(resumed is None or step > resumed,
                     f"--profile-flops-step {step} would never run: the checkpoint in --load {args.load} is at "
                     f"iteration {resumed}, so training resumes at iteration {(resumed or 0) + 1}")
    if args.peak_tflops is not None:
        _require(args.peak_tflops > 0, "--peak-tflops must be > 0")


def _writable_dir(path):
    """An existing writable directory, or one that can be created in an existing writable parent."""
    if os.path.exists(path) and not os.path.isdir(path):
        return False
    if os.path.isdir(path):
        return os.access(path, os.W_OK | os.X_OK)
    parent = os.path.dirname(os.path.abspath(path))
    return os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)


def _build_deepspeed_config(args):
    """The DeepSpeed config as a dict: the user's file, checked against the flags and completed by them."""
    config = {}
    if args.deepspeed_config:
        try:
            with open(args.deepspeed_config) as f:
                config = json.load(f)
        except OSError as error:
            raise ArgumentError(f"cannot read --deepspeed_config {args.deepspeed_config}: {error.strerror}")
        except json.JSONDecodeError as error:
            raise ArgumentError(f"--deepspeed_config {args.deepspeed_config} is not valid JSON: {error}")
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
    # Clipping happens in our optimizer (megatron/optimizer.py), by the true global norm; DeepSpeed's
    # own fp32 clipping miscounts under a pipeline. Its fp16/bf16 and ZeRO optimizers still clip
    # themselves: they wrap ours and hand it flat partitions, whose norm it cannot take.
    args.clip_grad = config.get("gradient_clipping", args.clip_grad)
    args.zero_stage = config.get("zero_optimization", {}).get("stage", 0)
    _require(args.zero_stage in (0, 1, 2, 3), "DeepSpeed config zero_optimization.stage must be 0, 1, 2 or 3")
    _require(args.zero_stage <= 1 or args.no_pipeline_parallel,
             f"ZeRO stage {args.zero_stage} cannot shard a pipeline's gradients: use stage 0 or 1 "
             f"(or --no-pipeline-parallel)")
    if args.fp16 or args.bf16 or args.zero_stage > 0:
        config["gradient_clipping"] = args.clip_grad
        args.clip_grad = 0.0
    else:
        config["gradient_clipping"] = 0.0
    _validate_flops_profiler_section(config.get("flops_profiler"))
    return config


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
