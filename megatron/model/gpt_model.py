"""GPT-2: the pipeline model (GPTModelPipe) and the same network without a pipeline (GPTModel)."""
import torch
import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from megatron import mpu
from megatron.model.fused_layer_norm import LayerNorm
from megatron.model.language_model import Embedding, EmbeddingPipe, lm_head_pipe, parallel_lm_logits
from megatron.model.transformer import ParallelTransformerLayer, ParallelTransformerLayerPipe

TIED_EMBEDDING_WEIGHT = ["word_embeddings.weight"]


def gpt_loss(logits, labels_and_mask):
    """Mean cross-entropy over the tokens the loss mask keeps."""
    labels, loss_mask = labels_and_mask
    losses = mpu.vocab_parallel_cross_entropy(logits.float(), labels)
    loss_mask = loss_mask.reshape(-1).float()
    return torch.sum(losses.reshape(-1) * loss_mask) / loss_mask.sum()


class GPTModelPipe(PipelineModule):
    """Layers: tied embedding, transformer layers 1..L, final LayerNorm, tied LM head."""

    def __init__(self, args):
        specs = [TiedLayerSpec("embed", EmbeddingPipe, args, tied_weight_attr=TIED_EMBEDDING_WEIGHT)]
        specs += [LayerSpec(ParallelTransformerLayerPipe, args, layer_number) for layer_number in range(args.num_layers)]
        specs += [LayerSpec(LayerNorm, args.hidden_size, eps=args.layernorm_epsilon)]
        specs += [TiedLayerSpec("embed", EmbeddingPipe, args, forward_fn=lm_head_pipe,
                                tied_weight_attr=TIED_EMBEDDING_WEIGHT)]
        interval = args.checkpoint_num_layers if args.checkpoint_activations else 0
        super().__init__(layers=specs, loss_fn=gpt_loss, topology=mpu.get_topology(),
                         partition_method="type:ParallelTransformerLayerPipe",
                         activation_checkpoint_interval=interval,
                         activation_checkpoint_func=deepspeed.checkpointing.checkpoint)


class GPTModel(torch.nn.Module):
    """The same network as GPTModelPipe, for --no-pipeline-parallel (a plain DeepSpeedEngine)."""

    def __init__(self, args):
        super().__init__()
        self.checkpoint_num_layers = args.checkpoint_num_layers if args.checkpoint_activations else 0
        self.embedding = Embedding(args)
        self.layers = torch.nn.ModuleList(
            [ParallelTransformerLayer(args, layer_number) for layer_number in range(args.num_layers)])
        self.final_layernorm = LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)

    def _run_layers(self, hidden_states):
        if not self.checkpoint_num_layers:
            for layer in self.layers:
                hidden_states = layer(hidden_states)
            return hidden_states
        for start in range(0, len(self.layers), self.checkpoint_num_layers):
            chunk = self.layers[start:start + self.checkpoint_num_layers]
            hidden_states = deepspeed.checkpointing.checkpoint(_run_chunk(chunk), hidden_states)
        return hidden_states

    def forward(self, input_ids, labels=None, loss_mask=None):
        hidden_states = self.final_layernorm(self._run_layers(self.embedding(input_ids)))
        logits = parallel_lm_logits(hidden_states, self.embedding.word_embeddings.weight)
        if labels is None:
            return logits
        return gpt_loss(logits, (labels, loss_mask))


def _run_chunk(layers):
    def run(hidden_states):
        for layer in layers:
            hidden_states = layer(hidden_states)
        return hidden_states
    return run
