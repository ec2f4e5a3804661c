"""RMSNorm, the one normalisation the MoE latent path and the KDA output gate share."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm(x) = x / sqrt(mean(x²) + eps) ⊙ weight over the last axis, computed in fp32, returned in x.dtype."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape [{x.shape[-1]}] (the last axis of x), got {tuple(weight.shape)}")
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
