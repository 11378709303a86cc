"""The transformer layer, tensor-parallel: pre-norm, causal self-attention, MLP.

GPT-2 by default (LayerNorm, multi-head attention, GELU MLP, biases); the LLaMA shape with
--normalization rmsnorm, --num-key-value-heads (grouped-query attention), --swiglu,
--use-rotary-position-embeddings and --disable-bias-linear.

Activations are [batch, sequence, hidden]. Attention runs through
torch.nn.functional.scaled_dot_product_attention, so FLOP counters see the attention kernels.
"""
import deepspeed
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.model.fused_layer_norm import norm_layer
from megatron.model.rotary import RotaryEmbedding
from megatron.model.utils import init_method_normal, scaled_init_method_normal, seeded_init


def layer_init_seed(seed, layer_number):
    """Each transformer layer draws its weights from its own seed, whatever stage builds it."""
    return seed + 7919 * (layer_number + 1)


class ParallelMLP(torch.nn.Module):
    """h -> f -> h with GELU; with --swiglu h -> 2f (two stacked halves a, b) -> silu(a) * b -> h."""

    def __init__(self, args, init_method, output_layer_init_method):
        super().__init__()
        self.swiglu = args.swiglu
        parts = 2 if self.swiglu else 1
        # stacked_parts: each tensor rank holds matching slices of both halves, so silu(a) * b is local.
        self.dense_h_to_4h = mpu.ColumnParallelLinear(
            args.hidden_size, parts * args.ffn_hidden_size, bias=args.add_bias_linear, gather_output=False,
            init_method=init_method, stacked_parts=parts)
        self.dense_4h_to_h = mpu.RowParallelLinear(
            args.ffn_hidden_size, args.hidden_size, bias=args.add_bias_linear, input_is_parallel=True,
            init_method=output_layer_init_method)

    def forward(self, hidden_states):
        intermediate, _ = self.dense_h_to_4h(hidden_states)
        if self.swiglu:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            activated = F.silu(gate) * up
        else:
            activated = F.gelu(intermediate)
        output, _ = self.dense_4h_to_h(activated)
        return output


def attention_core(query, key, value, dropout_p, query_groups):
    """softmax(Q K^T / sqrt(d)) V, causal, over this rank's heads.

    Key/value heads are repeated up to the query heads before the kernel: torch's FLOP counter then
    counts every query head's attention, as the dense formula does.
    """
    if query_groups > 1:
        key = key.repeat_interleave(query_groups, dim=1)
        value = value.repeat_interleave(query_groups, dim=1)
    if dropout_p > 0.0:
        # Heads are split over tensor ranks, so their dropout masks must differ across ranks.
        with mpu.get_cuda_rng_tracker().fork():
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=True)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True)


class CoreAttention(torch.nn.Module):
    """attention_core as a module, built under --recompute-granularity selective only: the part that
    re-runs in backward, and a module so the profiler attributes its recompute to it."""

    def __init__(self, attention_dropout, query_groups):
        super().__init__()
        self.attention_dropout = attention_dropout
        self.query_groups = query_groups

    def forward(self, query, key, value):
        dropout_p = self.attention_dropout if self.training else 0.0
        return attention_core(query, key, value, dropout_p, self.query_groups)


class ParallelAttention(torch.nn.Module):
    """Causal self-attention with heads (and key/value heads) split over tensor ranks.

    Query-key layer scaling (upstream's default, --no-query-key-layer-scaling turns it off) divides
    the scores by the layer number before upstream's fp16 score GEMM and multiplies them back inside
    its fp32 softmax: softmax(c x (Q K^T / (sqrt(d) c))) = softmax(Q K^T / sqrt(d)). It only keeps
    fp16 scores in range. Here the scores never exist as a tensor: scaled_dot_product_attention
    forms them inside its kernel with float accumulation, so the scaling is a numerical identity and
    the flag changes nothing.
    """

    def __init__(self, args, init_method, output_layer_init_method):
        super().__init__()
        tp_size = mpu.get_tensor_model_parallel_world_size()
        self.heads_per_partition = mpu.divide(args.num_attention_heads, tp_size)
        self.kv_heads_per_partition = mpu.divide(args.num_key_value_heads, tp_size)
        self.query_groups = args.num_attention_heads // args.num_key_value_heads
        self.head_dim = args.kv_channels
        projection = args.num_attention_heads * args.kv_channels
        kv_projection = args.num_key_value_heads * args.kv_channels
        # Output features are laid out by key/value head, [kv head][its query heads..., k, v][head_dim]
        # (for multi-head attention: [head][q|k|v][head_dim]), so that splitting the rows over
        # tensor-parallel ranks hands each rank whole key/value heads with the query heads that read them.
        self.query_key_value = mpu.ColumnParallelLinear(
            args.hidden_size, projection + 2 * kv_projection, bias=args.add_bias_linear, gather_output=False,
            init_method=init_method)
        self.rotary = None
        if args.use_rotary_position_embeddings:
            self.rotary = RotaryEmbedding(int(args.kv_channels * args.rotary_percent), base=args.rope_theta)
        self.attention_dropout = args.attention_dropout
        self.core_attention = None
        if args.recompute_granularity == "selective":
            self.core_attention = CoreAttention(args.attention_dropout, self.query_groups)
        self.dense = mpu.RowParallelLinear(
            projection, args.hidden_size, bias=args.add_bias_linear, input_is_parallel=True,
            init_method=output_layer_init_method)

    def _split_heads(self, mixed, batch, seq):
        """[b, s, features] -> query [b, heads, s, d], key and value [b, kv heads, s, d] (this rank's)."""
        if self.query_groups == 1:
            mixed = mixed.view(batch, seq, self.heads_per_partition, 3, self.head_dim)
            query, key, value = mixed.permute(3, 0, 2, 1, 4).unbind(0)
            return query, key, value
        groups = self.query_groups
        mixed = mixed.view(batch, seq, self.kv_heads_per_partition, groups + 2, self.head_dim)
        query = mixed[:, :, :, :groups].reshape(batch, seq, self.heads_per_partition, self.head_dim)
        return query.transpose(1, 2), mixed[:, :, :, groups].transpose(1, 2), mixed[:, :, :, groups + 1].transpose(1, 2)

    def forward(self, hidden_states):
        batch, seq, _ = hidden_states.shape
        mixed, _ = self.query_key_value(hidden_states)
        query, key, value = self._split_heads(mixed, batch, seq)
        if self.rotary is not None:
            query, key = self.rotary(query), self.rotary(key)
        if self.core_attention is None:
            dropout_p = self.attention_dropout if self.training else 0.0
            context = attention_core(query, key, value, dropout_p, self.query_groups)
        elif torch.is_grad_enabled():
            # DeepSpeed's checkpoint replays the tensor-parallel RNG, so dropout masks are redrawn alike.
            context = deepspeed.checkpointing.checkpoint(self.core_attention, query, key, value)
        else:
            context = self.core_attention(query, key, value)
        context = context.transpose(1, 2).reshape(batch, seq, self.heads_per_partition * self.head_dim)
        output, _ = self.dense(context)
        return output


class ParallelTransformerLayer(torch.nn.Module):
    def __init__(self, args, layer_number):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = args.hidden_dropout
        init_method = init_method_normal(args.init_method_std)
        output_init_method = scaled_init_method_normal(args.init_method_std, args.num_layers)
        with seeded_init(layer_init_seed(args.seed, layer_number)):
            self.input_layernorm = norm_layer(args)
            self.self_attention = ParallelAttention(args, init_method, output_init_method)
            self.post_attention_layernorm = norm_layer(args)
            self.mlp = ParallelMLP(args, init_method, output_init_method)

    def forward(self, hidden_states):
        # Hidden dropout runs outside the tensor-parallel region: the default generator, seeded alike
        # on every tensor rank of a stage, gives every rank the same mask.
        attention = self.self_attention(self.input_layernorm(hidden_states))
        hidden_states = hidden_states + F.dropout(attention, self.hidden_dropout, self.training)
        mlp = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + F.dropout(mlp, self.hidden_dropout, self.training)


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """The pipeline's layer: DeepSpeed passes the hidden states alone (attention is causal, no mask)."""

    def forward(self, inputs):
        hidden_states = inputs[0] if isinstance(inputs, tuple) else inputs
        return super().forward(hidden_states)
