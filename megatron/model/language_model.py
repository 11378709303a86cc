"""Word and position embeddings, and the LM head: the word embedding reused, or (untied) its own weight."""
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.model.utils import init_method_normal, seeded_init

# The untied LM head draws its weight from its own seed, whatever stage builds it.
LM_HEAD_SEED_OFFSET = 104729


class Embedding(torch.nn.Module):
    """Learned word (vocabulary-parallel) and position embeddings, summed, then dropout. With rotary
    position embeddings (applied in attention) there is no position table."""

    def __init__(self, args):
        super().__init__()
        init_method = init_method_normal(args.init_method_std)
        with seeded_init(args.seed):
            self.word_embeddings = mpu.VocabParallelEmbedding(
                args.padded_vocab_size, args.hidden_size, init_method=init_method)
            self.position_embeddings = None
            if args.add_position_embedding and not args.use_rotary_position_embeddings:
                self.position_embeddings = torch.nn.Embedding(args.max_position_embeddings, args.hidden_size)
                init_method(self.position_embeddings.weight.data)
        self.embedding_dropout = torch.nn.Dropout(args.hidden_dropout)

    def forward(self, input_ids):
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            embeddings = embeddings + self.position_embeddings(positions)
        return self.embedding_dropout(embeddings)


class _WeightOnly(torch.nn.Module):
    """Holds the LM head's weight under upstream's name, `lm_head.weight`, so checkpoints interoperate."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


class LMHead(torch.nn.Module):
    """The untied output layer: its own vocabulary-parallel weight [vocab / tp, hidden], no bias."""

    def __init__(self, args):
        super().__init__()
        with seeded_init(args.seed + LM_HEAD_SEED_OFFSET):
            self.lm_head = _WeightOnly(mpu.vocab_parallel_weight(args.padded_vocab_size, args.hidden_size,
                                                                 init_method_normal(args.init_method_std)))

    def forward(self, hidden_states):
        return parallel_lm_logits(hidden_states, self.lm_head.weight)


class LMHeadPipe(LMHead):
    """The last stage's untied LM head (DeepSpeed passes the hidden states alone)."""

    def forward(self, inputs):
        hidden_states = inputs[0] if isinstance(inputs, tuple) else inputs
        return super().forward(hidden_states)


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
