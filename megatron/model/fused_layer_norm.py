"""LayerNorm: apex's fused kernel when apex imports, torch's otherwise (same parameters, same math)."""
import torch

try:  # NVIDIA apex is optional; the package registry's `apex` is unrelated and is never a dependency.
    from apex.normalization import FusedLayerNorm as LayerNorm
    HAVE_APEX_LAYER_NORM = True
except Exception:  # ImportError, or an apex built for another torch
    LayerNorm = torch.nn.LayerNorm
    HAVE_APEX_LAYER_NORM = False

__all__ = ["LayerNorm", "HAVE_APEX_LAYER_NORM"]
