"""The Megatron-LM paper's FLOPs of one GPT training iteration (one data-parallel replica).

Forward, at 2 FLOPs per multiply-accumulate, attention counted dense:
    B s L (8 h^2 + 4 h f + 4 s h) + 2 B s h V      (= B s L (24 h^2 + 4 s h) + 2 B s h V for f = 4h)
Backward is twice the forward; activation checkpointing re-runs the transformer layers' forward
(the embedding and LM head are not recomputed). With f = 4h the sum is the paper's
24 c B s L h^2 (1 + s/(6h) + V/(16 L h)) with c = 3, or 4 under recompute.
"""


def gpt_layer_forward_flops(batch, seq, hidden, ffn_hidden):
    return batch * seq * (8 * hidden * hidden + 4 * hidden * ffn_hidden + 4 * seq * hidden)


def gpt_flops_per_iteration(args):
    """{'fwd_flops', 'bwd_flops', 'recompute_flops'} as exact ints."""
    batch = args.micro_batch_size * args.num_micro_batches
    layers = args.num_layers * gpt_layer_forward_flops(batch, args.seq_length, args.hidden_size, args.ffn_hidden_size)
    head = 2 * batch * args.seq_length * args.hidden_size * args.padded_vocab_size
    forward = layers + head
    return {"fwd_flops": forward, "bwd_flops": 2 * forward,
            "recompute_flops": layers if args.checkpoint_activations else 0}


def upstream_flops_per_iteration(args):
    """FLOPs of one iteration of the whole global batch by Megatron-DeepSpeed's throughput convention.

    Upstream's log line reports TFLOPs = this / (seconds per iteration x world size) / 1e12. Its
    formula is the paper's closed form, 24 c B s L h^2 (1 + s/(6h) + V/(16 L h)) with c = 4 under
    activation checkpointing and 3 otherwise, where B is the global batch: a float, not exact.
    """
    batch = args.global_batch_size
    factor = 4 if args.checkpoint_activations else 3
    h, s, layers, vocab = args.hidden_size, args.seq_length, args.num_layers, args.padded_vocab_size
    return 24 * factor * batch * s * layers * h * h * (1.0 + s / (6.0 * h) + vocab / (16.0 * layers * h))
