"""RMSNorm, the one normalisation the MoE latent path and the KDA output gate share."""

from __future__ import annotations

import torch

NORM_EPS = 1e-6  # ε of every RMSNorm in the model (and of Block AttnRes's key norm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """RMSNorm(x) = x / sqrt(mean(x²) + eps) ⊙ weight over the last axis, computed in fp32 (fp64 stays fp64),
    returned in x.dtype."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape [{x.shape[-1]}] (the last axis of x), got {tuple(weight.shape)}")
    wide = torch.promote_types(x.dtype, torch.float32)
    x_wide = x.to(wide)
    normed = x_wide * torch.rsqrt(x_wide.square().mean(-1, keepdim=True) + eps)
    return (normed * weight.to(wide)).to(x.dtype)
