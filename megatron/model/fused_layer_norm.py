"""LayerNorm (apex's fused kernel when apex imports, torch's otherwise: same parameters, same math) and RMSNorm."""
import torch

try:  # NVIDIA apex is optional; the package registry's `apex` is unrelated and is never a dependency.
    from apex.normalization import FusedLayerNorm as LayerNorm
    HAVE_APEX_LAYER_NORM = True
except Exception:  # ImportError, or an apex built for another torch
    LayerNorm = torch.nn.LayerNorm
    HAVE_APEX_LAYER_NORM = False


class RMSNorm(torch.nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, in float32 whatever the input dtype (as upstream); no bias."""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def norm_layer(args):
    """The normalization --normalization names, over the hidden size."""
    if args.normalization == "rmsnorm":
        return RMSNorm(args.hidden_size, eps=args.layernorm_epsilon)
    return LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)


__all__ = ["LayerNorm", "RMSNorm", "norm_layer", "HAVE_APEX_LAYER_NORM"]
