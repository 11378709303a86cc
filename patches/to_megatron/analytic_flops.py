"""The Megatron-LM paper's FLOPs of one GPT training iteration (one data-parallel replica), grown to
the LLaMA shape.

Forward, at 2 FLOPs per multiply-accumulate, attention counted dense, with n query heads, g key/value
heads, d the head size (n d = h unless --kv-channels says otherwise) and f the MLP's inner size:
    L B s (2 h (n d + 2 g d) + 2 n d h + 4 s n d + m h f) + 2 B s h V
where the query/key/value projection is 2 h (n d + 2 g d), the output projection 2 n d h, the two
attention GEMMs (Q K^T and P V) 4 s n d, and the MLP m h f with m = 4 (h -> f -> h) or, with SwiGLU,
m = 6 (h -> 2f -> h). For GPT-2 (g = n, n d = h) this is the paper's B s L (8 h^2 + 4 h f + 4 s h) +
2 B s h V (= B s L (24 h^2 + 4 s h) + 2 B s h V for f = 4h). Norms, rotary embeddings and the SwiGLU
product are elementwise and not counted.

Backward is twice the forward. Recompute: full activation checkpointing re-runs the transformer
layers' forward (the embedding and LM head are not recomputed; under --recompute-method block only
the first N layers of each stage; in a DeepSpeed pipeline only the layers of the chunks DeepSpeed
checkpoints, see pipeline_recomputed_layers); selective recompute re-runs the attention core only,
L B 4 s^2 n d.
"""
from argparse import Namespace
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

from patches.profiler.context import RunDescription

# One pipeline stage's layers in order: a transformer layer as its number (1..L), any other layer
# (embedding, final norm, LM head) as its name.
StageLayers = Sequence[Union[int, str]]


@dataclass(frozen=True)
class LayerShape:
    """What a transformer layer's FLOPs depend on."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    swiglu: bool = False

    @classmethod
    def from_args(cls, args: Namespace) -> "LayerShape":
        return cls(hidden=args.hidden_size, heads=args.num_attention_heads, kv_heads=args.num_key_value_heads,
                   head_dim=args.kv_channels, ffn_hidden=args.ffn_hidden_size, swiglu=args.swiglu)


def attention_core_forward_flops(batch: int, seq: int, shape: LayerShape) -> int:
    """softmax(Q K^T) V of one layer: two GEMMs of s x s x d per query head."""
    return batch * 4 * seq * seq * shape.heads * shape.head_dim


def layer_forward_flops(batch: int, seq: int, shape: LayerShape) -> int:
    h, d = shape.hidden, shape.head_dim
    query_width = shape.heads * d
    qkv = 2 * h * (query_width + 2 * shape.kv_heads * d)
    dense = 2 * query_width * h
    mlp = (6 if shape.swiglu else 4) * h * shape.ffn_hidden
    return batch * seq * (qkv + dense + mlp) + attention_core_forward_flops(batch, seq, shape)


def pipeline_recomputed_layers(stage_layers: Sequence[StageLayers], interval: int) -> List[int]:
    """The transformer layers a DeepSpeed PipelineModule recomputes with activation_checkpoint_interval
    `interval`, sorted: each stage's layers are cut into chunks of `interval`, counted from the stage's
    first layer, and a chunk is checkpointed only when every layer in it is a transformer layer
    (PipelineModule._is_checkpointable for GPT models under the reentrant checkpoint)."""
    recomputed = []
    for layers in stage_layers:
        for start in range(0, len(layers), interval):
            chunk = layers[start:start + interval]
            if all(isinstance(layer, int) for layer in chunk):
                recomputed += chunk
    return sorted(recomputed)


def _is_chunked_pipeline(args: Namespace, stage_layers: Optional[Sequence[StageLayers]]) -> bool:
    return (stage_layers is not None and bool(args.checkpoint_activations) and args.recompute_method != "block"
            and not getattr(args, "no_pipeline_parallel", False))


def recomputed_layers(args: Namespace, transformer_layers_per_stage: Optional[Sequence[int]] = None,
                      stage_layers: Optional[Sequence[StageLayers]] = None) -> int:
    """How many transformer layers full recompute re-runs: all of them (uniform), or under
    --recompute-method block the first --recompute-num-layers of each pipeline stage, which needs the
    model's cut into stages (transformer_layers_per_stage: how many layers each stage holds).

    stage_layers (each pipeline stage's layers, see StageLayers): the pipeline's layers in order, so that
    uniform recompute in a DeepSpeed pipeline counts only the chunks DeepSpeed checkpoints
    (pipeline_recomputed_layers); ignored under --no-pipeline-parallel, where every chunk of N is recomputed."""
    if stage_layers is not None and transformer_layers_per_stage is None:
        transformer_layers_per_stage = [sum(isinstance(layer, int) for layer in layers) for layers in stage_layers]
    per_stage = per_stage_recompute(args)
    if per_stage is not None:
        if transformer_layers_per_stage is None:
            raise ValueError("--pp-recompute-layers: the analytic recompute needs the transformer layers per stage")
        return sum(min(asked, count) for asked, count in zip(per_stage, transformer_layers_per_stage))
    if args.recompute_method != "block":
        if _is_chunked_pipeline(args, stage_layers):
            return len(pipeline_recomputed_layers(stage_layers, args.checkpoint_num_layers))
        return args.num_layers
    if transformer_layers_per_stage is None:
        raise ValueError("--recompute-method block: the analytic recompute needs the transformer layers per stage")
    return sum(min(args.checkpoint_num_layers, count) for count in transformer_layers_per_stage)


def per_stage_recompute(args: Namespace) -> Optional[Sequence[int]]:
    """--pp-recompute-layers' counts (stage s recomputes its first K_s transformer layers), or None."""
    counts = getattr(args, "pp_recompute_layers", None)
    return counts if isinstance(counts, (tuple, list)) else None


def _numbers(layers: Sequence[int]) -> str:
    return ", ".join(str(layer) for layer in layers) if layers else "none"


def recompute_shortfall(args: Namespace, stage_layers: Optional[Sequence[StageLayers]]) -> Optional[str]:
    """One line saying which transformer layers DeepSpeed's pipeline recomputes, and why, where that is fewer
    than --checkpoint-activations asks (all of them), or a stage holds fewer than --pp-recompute-layers asks it to
    recompute; None where it recomputes what the flags ask."""
    per_stage = per_stage_recompute(args)
    if per_stage is not None and stage_layers is not None:
        short = [(stage, asked, sum(isinstance(layer, int) for layer in layers))
                 for stage, (asked, layers) in enumerate(zip(per_stage, stage_layers))]
        short = [f"stage {stage} holds {held}, not {asked}" for stage, asked, held in short if held < asked]
        if not short:
            return None
        return (f"--pp-recompute-layers {','.join(map(str, per_stage))}: a stage recomputes every transformer layer "
                f"it holds where it holds fewer than asked: {'; '.join(short)}")
    if not _is_chunked_pipeline(args, stage_layers):
        return None
    interval = args.checkpoint_num_layers
    recomputed = pipeline_recomputed_layers(stage_layers, interval)
    if len(recomputed) == args.num_layers:
        return None
    kept = [layer for layer in range(1, args.num_layers + 1) if layer not in recomputed]
    mixed = []
    for stage, layers in enumerate(stage_layers):
        for start in range(0, len(layers), interval):
            chunk = layers[start:start + interval]
            if any(isinstance(layer, int) for layer in chunk) and not all(isinstance(layer, int) for layer in chunk):
                names = ", ".join(f"layer {layer}" if isinstance(layer, int) else layer for layer in chunk)
                mixed.append(f"stage {stage}'s [{names}]")
    return (f"activation checkpointing recomputes {len(recomputed)} of {args.num_layers} transformer layers "
            f"({_numbers(recomputed)}; not {_numbers(kept)}): DeepSpeed's PipelineModule checkpoints a chunk of "
            f"--checkpoint-num-layers {interval} layers, counted from each stage's first layer, only when all its "
            f"layers are transformer layers, unlike {' and '.join(mixed)}")


def gpt_flops_per_iteration(args: Namespace, transformer_layers_per_stage: Optional[Sequence[int]] = None,
                            stage_layers: Optional[Sequence[StageLayers]] = None) -> Dict[str, int]:
    """{'fwd_flops', 'bwd_flops', 'recompute_flops'} as exact ints (see recomputed_layers for the last two
    arguments)."""
    batch = args.micro_batch_size * args.num_micro_batches
    shape = LayerShape.from_args(args)
    layers = args.num_layers * layer_forward_flops(batch, args.seq_length, shape)
    head = 2 * batch * args.seq_length * args.hidden_size * args.padded_vocab_size
    forward = layers + head
    if args.checkpoint_activations or per_stage_recompute(args) is not None:
        recompute = recomputed_layers(args, transformer_layers_per_stage, stage_layers) * layer_forward_flops(
            batch, args.seq_length, shape)
    elif args.recompute_granularity == "selective":
        recompute = args.num_layers * attention_core_forward_flops(batch, args.seq_length, shape)
    else:
        recompute = 0
    return {"fwd_flops": forward, "bwd_flops": 2 * forward, "recompute_flops": recompute}


def upstream_flops_per_iteration(args: Namespace) -> float:
    """FLOPs of one iteration of the whole global batch by Megatron-DeepSpeed's throughput convention.

    Upstream's log line reports TFLOPs = this / (seconds per iteration x world size) / 1e12. Its
    formula (megatron/utils.py, throughput_calculator), in multiply-accumulates x 2, per layer and
    token: (2 + 2 // q) h^2 for the projections (q = heads / key-value heads; the integer division is
    upstream's), 2 d n s for attention (d = h / n, whatever --kv-channels says), (3 if SwiGLU else 2) f h
    for the MLP, plus V h for the LM head. Backward is twice the forward; full recompute adds a
    forward, selective recompute the attention term. B is the global batch; a float, like upstream's.
    (Upstream's older closed form, 24 c B s L h^2 (1 + s/(6h) + V/(16 L h)) with c = 3 or 4, is the
    same for GPT-2 with f = 4h except for the LM head: 4.5 B s h V there (6 under checkpointing),
    6 B s h V here (8).)
    """
    batch, s, layers = args.global_batch_size, args.seq_length, args.num_layers
    h, heads, vocab = args.hidden_size, args.num_attention_heads, args.padded_vocab_size
    query_groups = heads // args.num_key_value_heads
    projections = batch * layers * (1 + (2 // query_groups) + 1) * h * h * s
    attention = batch * layers * 2 * (h // heads) * heads * s * s
    mlp = batch * layers * (3 if args.swiglu else 2) * args.ffn_hidden_size * h * s
    head = batch * vocab * h * s
    forward = projections + attention + mlp + head
    total = 3 * forward
    if args.checkpoint_activations:
        total += forward
    elif args.recompute_granularity == "selective":
        total += attention
    return float(2 * total)


def gpt_run_description(args: Namespace, stage_layers: Optional[Sequence[StageLayers]],
                        log_line_args: Optional[Namespace] = None, peak_tflops: Optional[float] = None,
                        activation_checkpointing: Optional[bool] = None) -> RunDescription:
    """What a Megatron GPT run's arguments say of it, for the report: the formula's FLOPs of one iteration, the
    layers recomputed short of the flags, the log line's FLOPs (read from log_line_args, default args); each None
    where this Megatron's arguments lack what it reads; peak_tflops and activation_checkpointing where the caller
    knows them (RunDescription)."""
    try:
        analytic = gpt_flops_per_iteration(args, stage_layers=stage_layers)
    except (AttributeError, TypeError):  # a fork without these arguments: the report has no analytic column
        analytic = None
    try:
        log_line_flops = upstream_flops_per_iteration(log_line_args if log_line_args is not None else args)
    except (AttributeError, TypeError):
        log_line_flops = None
    return RunDescription(seq_length=args.seq_length, analytic=analytic, log_line_flops=log_line_flops,
                          recompute_note=recompute_shortfall(args, stage_layers) if analytic else None,
                          peak_tflops=peak_tflops, activation_checkpointing=activation_checkpointing)
