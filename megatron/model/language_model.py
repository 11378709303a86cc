"""Word and position embeddings, and the LM head that reuses the word embedding."""
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.model.utils import init_method_normal, seeded_init


class Embedding(torch.nn.Module):
    """Learned word (vocabulary-parallel) and position embeddings, summed, then dropout."""

    def __init__(self, args):
        super().__init__()
        init_method = init_method_normal(args.init_method_std)
        with seeded_init(args.seed):
            self.word_embeddings = mpu.VocabParallelEmbedding(
                args.padded_vocab_size, args.hidden_size, init_method=init_method)
            self.position_embeddings = torch.nn.Embedding(args.max_position_embeddings, args.hidden_size)
            init_method(self.position_embeddings.weight.data)
        self.embedding_dropout = torch.nn.Dropout(args.hidden_dropout)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.embedding_dropout(embeddings)


class EmbeddingPipe(Embedding):
    """First-stage embedding: DeepSpeed hands over the token ids (alone or as the first of a tuple)."""

    def forward(self, inputs):
        input_ids = inputs[0] if isinstance(inputs, tuple) else inputs
        return super().forward(input_ids)


def parallel_lm_logits(hidden_states, word_embeddings_weight):
    """Logits over this tensor rank's slice of the vocabulary (no bias, tied to the embedding)."""
    hidden_states = mpu.copy_to_tensor_model_parallel_region(hidden_states)
    return F.linear(hidden_states, word_embeddings_weight)


def lm_head_pipe(embedding, hidden_states):
    """The TiedLayerSpec forward_fn of the last stage: the tied embedding used as the LM head."""
    return parallel_lm_logits(hidden_states, embedding.word_embeddings.weight)
