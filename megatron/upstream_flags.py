"""Upstream Megatron-DeepSpeed flags this fork accepts without acting on them, and those it refuses.

An existing launch script must either run here or stop at start with one line saying which of its
flags asks for something this fork does not have; it must never stop at "unrecognized arguments"
for a flag upstream knows, nor ignore a feature silently.

- NO_OPS: flags that change nothing on this path: CUDA kernel switches, code paths DeepSpeed replaces,
  options upstream itself reads only elsewhere (without DeepSpeed, in BERT/T5), MoE settings with one
  expert. They are accepted and listed once in the log, each with why.
- UNSUPPORTED_OPTIONS: valued flags whose "off" value is accepted (`--num-experts 1`); any other value
  stops the run.
- UNSUPPORTED_FLAGS: any use stops the run. These are recognised by name before argparse runs, so
  their values need no parsing.
"""
import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


@dataclass(frozen=True)
class NoOpFlag:
    flags: tuple          # the option strings (the first is the name the log uses)
    why: str              # why it changes nothing here
    value_type: Optional[Callable] = None  # None: a switch
    choices: Optional[tuple] = None


@dataclass(frozen=True)
class UnsupportedOption:
    flag: str
    feature: str
    off: Any                     # upstream's default, the value that asks for nothing
    value_type: Callable = int
    nargs: Optional[str] = None
    choices: Optional[tuple] = None


_KERNEL = "a CUDA kernel switch; this fork runs plain PyTorch kernels"
_MEGATRON_DDP = "configures Megatron's own data-parallel/pipeline code, which DeepSpeed's engine replaces"
_ZERO_CONFIG = "the DeepSpeed config's zero_optimization section decides, as upstream"
_DEEPSPEED_SAVES = "upstream reads it only without DeepSpeed; DeepSpeed's engine saves and loads the optimizer"
_NEVER_READ = "upstream parses it and never reads it"
_NOT_GPT = "a BERT/T5/retriever data option; GPT pre-training does not read it (upstream's neither)"
_ONE_EXPERT = "an MoE setting; with one expert (--num-experts 1, the only value accepted) the model is dense"

NO_OPS = (
    NoOpFlag(("--no-async-tensor-model-parallel-allreduce",), "upstream turns it off under DeepSpeed too"),
    NoOpFlag(("--no-masked-softmax-fusion",), _KERNEL),
    NoOpFlag(("--no-bias-gelu-fusion",), _KERNEL),
    NoOpFlag(("--no-bias-dropout-fusion",), _KERNEL),
    NoOpFlag(("--no-gradient-accumulation-fusion",), _KERNEL),
    NoOpFlag(("--no-persist-layer-norm",), _KERNEL),
    NoOpFlag(("--use-flash-attn", "--use-flash-attn-v1"),
             "attention already runs torch's scaled_dot_product_attention (a flash kernel)"),
    NoOpFlag(("--use-flash-attn-v2",), "attention already runs torch's scaled_dot_product_attention (a flash kernel)"),
    NoOpFlag(("--use-flash-attn-triton",),
             "attention already runs torch's scaled_dot_product_attention (a flash kernel)"),
    NoOpFlag(("--use-flash-attn-builder",),
             "attention already runs torch's scaled_dot_product_attention (a flash kernel)"),
    NoOpFlag(("--accumulate-allreduce-grads-in-fp32",),
             "DeepSpeed decides: with bf16 and no ZeRO, its pipeline accumulates and all-reduces gradients in bf16 "
             "(it warns so); fp32 accumulation is its data_types.grad_accum_dtype fp32, which needs ZeRO stage 1"),
    NoOpFlag(("--no-contiguous-buffers-in-local-ddp",), _MEGATRON_DDP),
    NoOpFlag(("--no-scatter-gather-tensors-in-pipeline",), _MEGATRON_DDP),
    NoOpFlag(("--use-ring-exchange-p2p",), _MEGATRON_DDP),
    NoOpFlag(("--overlap-p2p-communication",), _MEGATRON_DDP),
    NoOpFlag(("--DDP-impl",), _MEGATRON_DDP, value_type=str, choices=("local", "torch")),
    NoOpFlag(("--use-cpu-initialization",), "weights are initialised the same on CPU and GPU here"),
    NoOpFlag(("--empty-unused-memory-level",), "a CUDA cache-release switch", value_type=int, choices=(0, 1, 2)),
    NoOpFlag(("--zero-reduce-scatter",), _ZERO_CONFIG),
    NoOpFlag(("--zero-contigious-gradients",), _ZERO_CONFIG),
    NoOpFlag(("--zero-reduce-bucket-size",), _ZERO_CONFIG, value_type=int),
    NoOpFlag(("--zero-allgather-bucket-size",), _ZERO_CONFIG, value_type=int),
    NoOpFlag(("--use-pin-memory",), "pins memory for ZeRO-3 parameter offload, which is refused here"),
    NoOpFlag(("--timing-log-level",), "upstream's level 1 and 2 timers (forward-backward, optimizer, ...) time "
                                      "its own schedule; on DeepSpeed's pipeline, as here, it runs none of them, "
                                      "and level 0's is the iteration time in the log line",
             value_type=int, choices=(0, 1, 2)),
    NoOpFlag(("--no-barrier-with-level-1-timing",), "only affects upstream's per-operation timers (not reported)"),
    NoOpFlag(("--timing-log-option",), "only affects upstream's per-operation timers (not reported)",
             value_type=str, choices=("max", "minmax", "all")),
    NoOpFlag(("--disable-mem-efficient-ln",), _KERNEL),
    NoOpFlag(("--onnx-safe",), "picks an ONNX-exportable GELU in upstream's BERT; GPT training is the same"),
    NoOpFlag(("--mmap-warmup",), "only pre-reads the data files; the samples are the same"),
    NoOpFlag(("--no-save-optim",), _DEEPSPEED_SAVES),
    NoOpFlag(("--no-load-lr-state",), _NEVER_READ),
    NoOpFlag(("--no-initialization",), _NEVER_READ),
    NoOpFlag(("--exit-on-missing-checkpoint",),
             "upstream reads it only without DeepSpeed; with DeepSpeed a missing checkpoint starts from scratch"),
    NoOpFlag(("--distribute-checkpointed-activations", "--distribute-saved-activations"),
             "splits Megatron's own recompute buffers; DeepSpeed's pipeline recomputes through "
             "deepspeed.checkpointing, whose counterpart is --partition-activations"),
    NoOpFlag(("--trust-remote-code",), "only read by HFTokenizer, which this fork does not have"),
    NoOpFlag(("--bert-no-binary-head",), _NOT_GPT),
    NoOpFlag(("--mask-prob",), _NOT_GPT, value_type=float),
    NoOpFlag(("--short-seq-prob",), _NOT_GPT, value_type=float),
    NoOpFlag(("--vocab-extra-ids",), _NOT_GPT, value_type=int),
    NoOpFlag(("--retriever-seq-length",), _NOT_GPT, value_type=int),
    NoOpFlag(("--sample-rate",), _NOT_GPT, value_type=float),
    NoOpFlag(("--no-data-sharding",), "only read by upstream's cyclic data loader (--dataloader-type cyclic, "
                                      "refused here); the single loader reads the same samples"),
    # Upstream's dense scripts pass MoE settings with one expert: then every layer is dense and they change nothing.
    NoOpFlag(("--mlp-type",), _ONE_EXPERT, value_type=str, choices=("standard", "residual")),
    NoOpFlag(("--topk",), _ONE_EXPERT, value_type=int),
    NoOpFlag(("--expert-interval",), _ONE_EXPERT, value_type=int),
    NoOpFlag(("--moe-train-capacity-factor",), _ONE_EXPERT, value_type=float),
    NoOpFlag(("--moe-eval-capacity-factor",), _ONE_EXPERT, value_type=float),
    NoOpFlag(("--moe-min-capacity",), _ONE_EXPERT, value_type=int),
    NoOpFlag(("--moe-loss-coeff",), _ONE_EXPERT, value_type=float),
    NoOpFlag(("--disable-moe-token-dropping",), _ONE_EXPERT),
    NoOpFlag(("--create-moe-param-group",), _ONE_EXPERT),
    NoOpFlag(("--disable-moe-top2-2nd-expert-sampling",), _ONE_EXPERT),
    NoOpFlag(("--use-tutel",), _ONE_EXPERT),
    NoOpFlag(("--enable-expert-tensor-parallelism",), _ONE_EXPERT),
)

_MOE = "mixture of experts (MoE)"
_ULYSSES = "DeepSpeed sequence parallelism (Ulysses)"
UNSUPPORTED_OPTIONS = (
    UnsupportedOption("--num-experts", _MOE, off=[1], nargs="+"),
    UnsupportedOption("--moe-expert-parallel-size", _MOE, off=1),
    UnsupportedOption("--ds-sequence-parallel-size", _ULYSSES, off=1),
    UnsupportedOption("--wandb-project", "Weights & Biases logging", off="", value_type=str),
    UnsupportedOption("--wandb-exp-name", "Weights & Biases logging", off="", value_type=str),
    UnsupportedOption("--wandb-save-dir", "Weights & Biases logging", off="", value_type=str),
    UnsupportedOption("--remote-device", "ZeRO-3 parameter offload", off="none", value_type=str,
                      choices=("none", "cpu", "nvme")),
    UnsupportedOption("--transformer-impl", "Transformer Engine", off="local", value_type=str,
                      choices=("local", "transformer_engine")),
)

# feature -> flags; any use of one of them stops the run.
_REFUSED_BY_FEATURE = {
    _MOE: ("--num-experts-switch",),
    "Megatron-LM sequence parallelism": ("--sequence-parallel",),
    _ULYSSES: ("--force-ds-sequence-parallel", "--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size",
               "--ds-sequence-parallel-fpdt-offloading"),
    "random layer token drop (random-LTD)": ("--random-ltd",),
    "DeepSpeed data-efficiency curriculum learning": ("--data-efficiency-curriculum-learning",),
    "batch-size ramp-up": ("--rampup-batch-size",),
    "the interleaved pipeline schedule": ("--num-layers-per-virtual-pipeline-stage",),
    "the zero-bubble pipeline schedule": ("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"),
    "an encoder-decoder pipeline split": ("--pipeline-model-parallel-split-rank",),
    "a standalone embedding pipeline stage (see --pp-partition-method)": ("--standalone-embedding-stage",),
    "Megatron's distributed optimizer (use ZeRO stage 1 in the DeepSpeed config)": ("--use-distributed-optimizer",),
    "CPU and fused-Adam optimizer variants": ("--cpu-optimizer", "--cpu_torch_adam", "--ds_fused_adam"),
    "inference mode": ("--inference", "--ds-inference", "--inference-batch-times-seqlen-threshold",
                       "--max-tokens-to-oom", "--output-bert-embeddings", "--bert-embedder-type"),
    "knowledge distillation and mixture of students": (
        "--mos", "--kd", "--kd-alpha-ce", "--kd-beta-ce", "--kd-temp", "--num-layers-teacher",
        "--num-experts-teacher", "--hidden-size-teacher", "--num-attention-heads-teacher", "--load-teacher",
        "--reset-iteration"),
    "memory optimisations (tiled linear, split transformers, scattered embeddings)": (
        "--scattered-embeddings", "--split-transformers", "--memory-centric-tiled-linear", "--tile-factor"),
    "lazy model-parallel initialisation": ("--lazy-mpu-init",),
    "per-replica random initialisation": ("--data-parallel-random-init",),
    "upstream's torch profiler (this fork profiles FLOPs with --profile-flops-step)": (
        "--profile", "--profile_steps", "--profile-ranks"),
    "DeepSpeed universal checkpoints": ("--universal-checkpoint",),
    "taking the model's flags from the checkpoint (--use-checkpoint-args; give the flags)": (
        "--use-checkpoint-args",),
    "encoder-decoder (T5) shapes (give --num-layers and --seq-length)": (
        "--encoder-num-layers", "--decoder-num-layers", "--encoder-seq-length", "--decoder-seq-length"),
    "separate train/valid/test data paths (give --data-path and --split)": (
        "--train-data-path", "--valid-data-path", "--test-data-path"),
    "prebuilt dataset index files": (
        "--train-desc-path", "--train-doc-idx-path", "--train-idx-path", "--train-sample-idx-path",
        "--train-shuffle-idx-path", "--train-data-exact-num-epochs", "--return-data-index"),
    "Azure ML data download": ("--aml-data-download-path",),
    "a repeating data loader": ("--repeated-dataloader",),
    "the NullTokenizer's --vocab-size": ("--vocab-size",),
    "resetting position ids and attention masks at document ends": ("--reset-position-ids",
                                                                    "--reset-attention-mask"),
    "masking end-of-document tokens out of the loss": ("--eod-mask-loss",),
    "LayerNorm variants (1p, residual after the norm)": ("--apply-layernorm-1p",
                                                         "--apply-residual-connection-post-layernorm"),
    "activation variants (OpenAI GELU, squared ReLU)": ("--openai-gelu", "--squared-relu"),
    "Xavier-uniform initialisation": ("--init-method-xavier-uniform",),
    "fp32 embedding weights under bf16": ("--embedding-weights-in-fp32",),
    "memory logging to TensorBoard": ("--log-memory-to-tensorboard",),
    "saving and exiting on SIGTERM": ("--exit-signal-handler",),
    "a kill-switch file": ("--kill-switch-file",),
    "ADLR auto-resume": ("--adlr-autoresume", "--adlr-autoresume-interval"),
    "--skip-train (evaluation only)": ("--skip-train",),
    "--use-dataset-only (an external trainer)": ("--use-dataset-only",),
    "fp32 residual connections": ("--fp32-residual-connection",),
    "the attention softmax precision switch": ("--attention-softmax-in-fp32",),
    "an fp16 LM-head cross entropy": ("--fp16-lm-cross-entropy",),
    "Transformer Engine fp8": ("--fp8-e4m3", "--fp8-hybrid", "--no-fp8-wgrad", "--fp8-margin", "--fp8-interval",
                               "--fp8-amax-history-len", "--fp8-amax-compute-algo"),
    "RETRO": ("--retro-workdir", "--retro-add-retriever", "--retro-cyclic-train-iters", "--retro-encoder-layers",
              "--retro-encoder-hidden-dropout", "--retro-encoder-attention-dropout", "--retro-num-neighbors",
              "--retro-num-retrieved-chunks", "--retro-return-doc-ids"),
    "biencoder / ICT / REALM": (
        "--ict-head-size", "--biencoder-projection-dim", "--biencoder-shared-query-context-model", "--ict-load",
        "--bert-load", "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs", "--evidence-data-path",
        "--retriever-report-topk-accuracies", "--retriever-score-scaling", "--block-data-path", "--embedding-path",
        "--indexer-batch-size", "--indexer-log-interval"),
    "vision models": (
        "--num-classes", "--img-h", "--img-w", "--num-channels", "--patch-dim", "--classes-fraction",
        "--data-per-class-fraction", "--head-lr-mult", "--vision-pretraining",
        "--vision-pretraining-type", "--vision-backbone-type", "--swin-backbone-type", "--mask-type", "--mask-factor",
        "--iter-per-epoch", "--dino-local-img-size", "--dino-local-crops-number", "--dino-head-hidden-size",
        "--dino-bottleneck-size", "--dino-freeze-last-layer", "--dino-norm-last-layer", "--dino-warmup-teacher-temp",
        "--dino-teacher-temp", "--dino-warmup-teacher-temp-epochs"),
}
# Flags upstream itself rejects with a pointer to their successor.
_DEPRECATED = {
    "--batch-size": "--batch-size is no longer valid upstream either: use --micro-batch-size",
    "--warmup": "--warmup is no longer valid upstream either: use --lr-warmup-fraction or --lr-warmup-iters",
    "--model-parallel-size":
        "--model-parallel-size is no longer valid upstream either: use --tensor-model-parallel-size",
}
UNSUPPORTED_FLAGS = {flag: feature for feature, flags in _REFUSED_BY_FEATURE.items() for flag in flags}

# DeepSpeed config sections asking for features this fork does not have (when enabled).
UNSUPPORTED_CONFIG_SECTIONS = {
    "curriculum_learning": "curriculum learning",
    "data_efficiency": "DeepSpeed data efficiency (curriculum learning, random-LTD)",
    "compression_training": "compression training",
}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_no_op_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("upstream switches accepted without effect here (listed once in the log)")
    for entry in NO_OPS:
        dest = _dest(entry.flags[0])
        if entry.value_type is None:
            group.add_argument(*entry.flags, dest=dest, action="store_true", help=entry.why)
        else:
            group.add_argument(*entry.flags, dest=dest, type=entry.value_type, choices=entry.choices, default=None,
                               help=entry.why)


def add_unsupported_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("upstream features not in this fork (accepted only at their 'off' value)")
    for option in UNSUPPORTED_OPTIONS:
        group.add_argument(option.flag, dest=_dest(option.flag), type=option.value_type, nargs=option.nargs,
                           choices=option.choices, default=option.off,
                           help=f"{option.feature}: not supported here; only {_format(option.off)} is accepted")


def given_no_ops(args: argparse.Namespace) -> list:
    """'--flag (why)' for every no-op flag the command line set."""
    given = []
    for entry in NO_OPS:
        value = getattr(args, _dest(entry.flags[0]))
        if value is True or (entry.value_type is not None and value is not None):
            given.append(f"{entry.flags[0]} ({entry.why})")
    return given


def refused_on_command_line(argv: Sequence[str], known: Callable[[str], bool]) -> Optional[str]:
    """The one-line reason the first refused flag in argv stops the run, or None.

    `known(flag)` says whether the parser itself defines the flag (then it is never refused here).
    """
    for token in argv:
        if not token.startswith("--"):
            continue
        flag = token.split("=", 1)[0]
        if known(flag):
            continue
        if flag in _DEPRECATED:
            return _DEPRECATED[flag]
        if flag in UNSUPPORTED_FLAGS:
            return f"{flag}: {UNSUPPORTED_FLAGS[flag]} is not supported here"
    return None


def refused_option_value(args: argparse.Namespace) -> Optional[str]:
    """The one-line reason a valued unsupported option set to anything but its 'off' value stops the run."""
    for option in UNSUPPORTED_OPTIONS:
        value = getattr(args, _dest(option.flag))
        off = all(v in option.off for v in value) if isinstance(option.off, list) else value == option.off
        if not off:
            return f"{option.flag} {_format(value)}: {option.feature} is not supported here " \
                   f"(only {option.flag} {_format(option.off)} is accepted)"
    return None


def refused_config_section(config: dict) -> Optional[str]:
    for key, feature in UNSUPPORTED_CONFIG_SECTIONS.items():
        section = config.get(key)
        if section is None:
            continue
        enabled = section.get("enabled", True) if isinstance(section, dict) else bool(section)
        if enabled:
            return f"DeepSpeed config section {key!r}: {feature} is not supported here"
    return None


def _format(value) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return repr(value) if value == "" else str(value)
