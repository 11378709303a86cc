"""GPT (GPT-2 or the LLaMA shape): the pipeline model (GPTModelPipe) and the same network without a
pipeline (GPTModel)."""
import re

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime import utils as ds_utils

from megatron import mpu
from megatron.model.fused_layer_norm import LayerNorm, RMSNorm, norm_layer
from megatron.model.language_model import Embedding, EmbeddingPipe, LMHead, LMHeadPipe, lm_head_pipe, parallel_lm_logits
from megatron.model.transformer import ParallelTransformerLayer, ParallelTransformerLayerPipe

TIED_EMBEDDING_WEIGHT = ["word_embeddings.weight"]


def gpt_loss(logits, labels_and_mask):
    """Mean cross-entropy over the tokens the loss mask keeps."""
    labels, loss_mask = labels_and_mask
    losses = mpu.vocab_parallel_cross_entropy(logits.float(), labels)
    loss_mask = loss_mask.reshape(-1).float()
    return torch.sum(losses.reshape(-1) * loss_mask) / loss_mask.sum()


def pipeline_layer_specs(args):
    """Embedding, transformer layers 1..L, final norm, LM head (nothing is built yet).

    Tied (default): the embedding and the LM head are one TiedLayerSpec on the first and last stages.
    Untied: a plain embedding on the first stage, its own LM head on the last.
    """
    untied = args.untie_embeddings_and_output_weights
    if untied:
        specs = [LayerSpec(EmbeddingPipe, args)]
    else:
        specs = [TiedLayerSpec("embed", EmbeddingPipe, args, tied_weight_attr=TIED_EMBEDDING_WEIGHT)]
    specs += [LayerSpec(ParallelTransformerLayerPipe, args, layer_number) for layer_number in range(args.num_layers)]
    norm = RMSNorm if args.normalization == "rmsnorm" else LayerNorm
    specs += [LayerSpec(norm, args.hidden_size, eps=args.layernorm_epsilon)]
    if untied:
        specs += [LayerSpec(LMHeadPipe, args)]
    else:
        specs += [TiedLayerSpec("embed", EmbeddingPipe, args, forward_fn=lm_head_pipe,
                                tied_weight_attr=TIED_EMBEDDING_WEIGHT)]
    return specs


def stage_boundaries(args, num_stages):
    """Where DeepSpeed's PipelineModule will cut pipeline_layer_specs(args) into stages.

    Returns (boundaries, weights): stage i holds specs boundaries[i]:boundaries[i+1]; weights[j] is
    what the partition method counts for spec j (1 or 0 for 'type:REGEX', 1 for 'uniform'). DeepSpeed's
    own partition functions and matching rule, so the flags can be checked before any process group.
    """
    specs = pipeline_layer_specs(args)
    names = [spec.typename.__name__ for spec in specs]
    if args.pp_partition_from_profile:  # where a profiled run's measured layers say (patches.partition)
        from patches.partition.layers import layer_type
        from patches.partition.method import memory_limit, profiled_parts

        # under the limit partition_method='profile' plans with (--pp-partition-memory-limit, else the device's)
        return profiled_parts(args.pp_partition_from_profile, [layer_type(spec) for spec in specs], num_stages,
                              *memory_limit()), \
            [1] * len(specs)
    method = args.pp_partition_method
    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(names), num_parts=num_stages), [1] * len(names)
    if method == "parameters":
        weights = [layer_params(args, name) for name in names]
        return ds_utils.partition_balanced(weights=weights, num_parts=num_stages), weights
    pattern = re.compile(method[len("type:"):], re.IGNORECASE)
    weights = [1 if pattern.search(name) else 0 for name in names]
    return ds_utils.partition_balanced(weights=weights, num_parts=num_stages), weights


def layer_params(args, name):
    """The trainable parameters of one pipeline layer on one tensor rank, as DeepSpeed's 'parameters' method
    counts them (it builds each layer; a tied layer counts as the whole embedding wherever it is used)."""
    tp, hidden = args.tensor_model_parallel_size, args.hidden_size
    vocab = args.padded_vocab_size // tp * hidden
    if name == "EmbeddingPipe":
        learned_positions = args.add_position_embedding and not args.use_rotary_position_embeddings
        return vocab + (args.max_position_embeddings * hidden if learned_positions else 0)
    if name == "LMHeadPipe":
        return vocab
    norm = hidden if args.normalization == "rmsnorm" else 2 * hidden  # LayerNorm has a bias
    if name in ("LayerNorm", "RMSNorm", "FusedLayerNorm"):
        return norm
    bias = int(args.add_bias_linear)
    query, key_value = args.num_attention_heads * args.kv_channels, args.num_key_value_heads * args.kv_channels
    qkv = (query + 2 * key_value) // tp  # column-parallel: weight and bias split
    ffn = args.ffn_hidden_size // tp
    up = (2 if args.swiglu else 1) * ffn
    # row-parallel (dense, dense_4h_to_h): the weight split, the bias whole
    return 2 * norm + (hidden + bias) * qkv + query // tp * hidden + bias * hidden + (hidden + bias) * up \
        + ffn * hidden + bias * hidden


def transformer_layers_per_stage(args):
    """How many transformer layers each pipeline stage holds (one stage under --no-pipeline-parallel)."""
    return [sum(isinstance(layer, int) for layer in layers) for layers in pipeline_stage_layers(args)]


def pipeline_stage_layers(args):
    """Each pipeline stage's layers in order, as patches.to_megatron.analytic_flops reads them (a transformer layer
    as its number 1..L, the others by name); one stage under --no-pipeline-parallel."""
    stages = 1 if args.no_pipeline_parallel else args.pipeline_model_parallel_size
    boundaries, _ = stage_boundaries(args, stages)
    names = ["embedding"] + list(range(1, args.num_layers + 1)) + ["final norm", "LM head"]
    return [names[boundaries[i]:boundaries[i + 1]] for i in range(stages)]


UPSTREAM_LAYER_FILE_OFFSET = 1


class GPTModelPipe(PipelineModule):
    """Stages cut by --pp-partition-method (default: balance the transformer layers; Megatron-DeepSpeed's
    'type:transformer|embedding' also weighs the embedding and the LM head), or where a profiled run says
    (--pp-partition-from-profile)."""

    def __init__(self, args):
        # uniform: every chunk of N layers, counted from the stage's first layer, that holds transformer layers
        # only (DeepSpeed's rule: a chunk with the embedding, the final norm or the LM head is run without
        # checkpointing). block (--recompute-method block) and --pp-recompute-layers: the patch set's per-stage
        # recompute (patches.to_megatron.megatron_flags.block_recompute_as_stage_counts) chooses each stage's layers.
        interval = args.checkpoint_num_layers if args.checkpoint_activations else 0
        super().__init__(layers=pipeline_layer_specs(args), loss_fn=gpt_loss, topology=mpu.get_topology(),
                         partition_method=partition_method(args),
                         activation_checkpoint_interval=interval,
                         activation_checkpoint_func=deepspeed.checkpointing.checkpoint)
        if getattr(self, "planned_recompute", None) is not None:
            # the profile's plan chose each stage's recompute with its parts: the run's description follows it
            args.pp_recompute_layers = self.planned_recompute
        expected, _ = stage_boundaries(args, self.num_stages)
        if list(self.parts) != list(expected):  # the analytic FLOPs and the flag checks read stage_boundaries
            raise RuntimeError(f"DeepSpeed cut the layers at {list(self.parts)}, stage_boundaries() at {expected}")

    # Upstream's GPTModelPipe has a dtype-cast function as its first layer, so its layer files are
    # numbered one above this model's specs: name them as upstream does, and either side's pipeline
    # checkpoints load in the other.
    def ckpt_layer_path(self, ckpt_dir, local_layer_idx):
        return super().ckpt_layer_path(ckpt_dir, local_layer_idx + UPSTREAM_LAYER_FILE_OFFSET)

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx):
        return super().ckpt_layer_path_list(ckpt_dir, local_layer_idx + UPSTREAM_LAYER_FILE_OFFSET)


def partition_method(args):
    """DeepSpeed's partition_method for --pp-partition-method, or 'profile:REPORT' (--pp-partition-from-profile)."""
    return f"profile:{args.pp_partition_from_profile}" if args.pp_partition_from_profile else args.pp_partition_method


def recompute_block_layers(args):
    """N under --recompute-method block (the first N layers of each stage are recomputed), else 0."""
    return args.checkpoint_num_layers if args.checkpoint_activations and args.recompute_method == "block" else 0


class GPTModel(torch.nn.Module):
    """The same network as GPTModelPipe, for --no-pipeline-parallel (a plain DeepSpeedEngine)."""

    def __init__(self, args):
        super().__init__()
        self.checkpoint_num_layers = args.checkpoint_num_layers if args.checkpoint_activations else 0
        self.recompute_block_layers = recompute_block_layers(args)
        self.embedding = Embedding(args)
        self.layers = torch.nn.ModuleList(
            [ParallelTransformerLayer(args, layer_number) for layer_number in range(args.num_layers)])
        self.final_layernorm = norm_layer(args)
        self.lm_head = LMHead(args) if args.untie_embeddings_and_output_weights else None

    def _run_layers(self, hidden_states):
        if self.recompute_block_layers:
            for index, layer in enumerate(self.layers):
                if index < self.recompute_block_layers:
                    hidden_states = deepspeed.checkpointing.checkpoint(layer, hidden_states)
                else:
                    hidden_states = layer(hidden_states)
            return hidden_states
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
        if self.lm_head is not None:
            logits = self.lm_head(hidden_states)
        else:
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
