"""Rotary position embeddings (RoFormer), in upstream Megatron's layout: the rotated channels are the
first `dim` of each head, split into two halves that rotate together (not interleaved pairs)."""
import torch


def _rotate_half(x):
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Rotates [batch, heads, seq, head_dim] tensors by their positions 0..seq-1. Elementwise work only."""

    def __init__(self, dim, base=10000):
        super().__init__()
        self.dim = dim
        self.base = base

    def _angles(self, seq, device):
        # Computed per call by elementwise products (no matmul), so FLOP counters see no GEMM here.
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim))
        positions = torch.arange(seq, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq[None, :]
        return torch.cat((freqs, freqs), dim=-1)  # [seq, dim]

    def forward(self, x):
        angles = self._angles(x.shape[-2], x.device)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        rotated, passed = x[..., :self.dim], x[..., self.dim:]
        rotated = rotated * cos + _rotate_half(rotated) * sin
        if passed.shape[-1] == 0:
            return rotated
        return torch.cat((rotated, passed), dim=-1)
