"""The GPT-2 transformer layer, tensor-parallel: pre-LayerNorm, causal self-attention, GELU MLP.

Activations are [batch, sequence, hidden]. Attention runs through
torch.nn.functional.scaled_dot_product_attention, so FLOP counters see the attention kernels.
"""
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.model.fused_layer_norm import LayerNorm
from megatron.model.utils import init_method_normal, scaled_init_method_normal, seeded_init


def layer_init_seed(seed, layer_number):
    """Each transformer layer draws its weights from its own seed, whatever stage builds it."""
    return seed + 7919 * (layer_number + 1)


class ParallelMLP(torch.nn.Module):
    def __init__(self, args, init_method, output_layer_init_method):
        super().__init__()
        self.dense_h_to_4h = mpu.ColumnParallelLinear(
            args.hidden_size, args.ffn_hidden_size, gather_output=False, init_method=init_method)
        self.dense_4h_to_h = mpu.RowParallelLinear(
            args.ffn_hidden_size, args.hidden_size, input_is_parallel=True, init_method=output_layer_init_method)

    def forward(self, hidden_states):
        intermediate, _ = self.dense_h_to_4h(hidden_states)
        output, _ = self.dense_4h_to_h(F.gelu(intermediate))
        return output


class ParallelAttention(torch.nn.Module):
    def __init__(self, args, init_method, output_layer_init_method):
        super().__init__()
        tp_size = mpu.get_tensor_model_parallel_world_size()
        self.heads_per_partition = mpu.divide(args.num_attention_heads, tp_size)
        self.head_dim = mpu.divide(args.hidden_size, args.num_attention_heads)
        self.attention_dropout = args.attention_dropout
        # Output features are laid out head by head, [head][q|k|v][head_dim], so that splitting the
        # rows over tensor-parallel ranks hands each rank whole heads.
        self.query_key_value = mpu.ColumnParallelLinear(
            args.hidden_size, 3 * args.hidden_size, gather_output=False, init_method=init_method)
        self.dense = mpu.RowParallelLinear(
            args.hidden_size, args.hidden_size, input_is_parallel=True, init_method=output_layer_init_method)

    def forward(self, hidden_states):
        batch, seq, _ = hidden_states.shape
        mixed, _ = self.query_key_value(hidden_states)
        mixed = mixed.view(batch, seq, self.heads_per_partition, 3, self.head_dim)
        query, key, value = mixed.permute(3, 0, 2, 1, 4).unbind(0)  # each [b, heads, s, head_dim]
        dropout_p = self.attention_dropout if self.training else 0.0
        if dropout_p > 0.0:
            # Heads are split over tensor ranks, so their dropout masks must differ across ranks.
            with mpu.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=True)
        else:
            context = F.scaled_dot_product_attention(query, key, value, is_causal=True)
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
            self.input_layernorm = LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)
            self.self_attention = ParallelAttention(args, init_method, output_init_method)
            self.post_attention_layernorm = LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)
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
