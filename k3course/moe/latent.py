"""The latent half of K3's Stable LatentMoE, and the accounting that motivates it.

Routed experts run on z = x W↓ ∈ R^ℓ; their weighted sum u is normalised and projected back:
y_routed = RMSNorm(u) W↑. Tokens cross the network (all-to-all) at width ℓ instead of d.
"""

from __future__ import annotations

import torch

from k3course.ops.norm import NORM_EPS, rms_norm


def latent_combine(expert_out: torch.Tensor, weights: torch.Tensor, up_proj: torch.Tensor, norm_weight: torch.Tensor,
                   eps: float = NORM_EPS) -> torch.Tensor:
    """The routed output of a latent MoE: RMSNorm(Σ_i p_ti E_i(z_t)) W↑.

    expert_out [m, k, ℓ] (slot i of token t holds E_{idx_ti}(z_t)), weights [m, k], up_proj [ℓ, d],
    norm_weight [ℓ] -> [m, d]. The norm acts on the weighted sum, once per token, before the up-projection.
    """
    u = torch.einsum("mk,mkl->ml", weights.to(expert_out.dtype), expert_out)  # [m, ℓ]
    return rms_norm(u, norm_weight, eps) @ up_proj


def moe_flops_per_token(d_model: int, n_routed_experts: int, top_k: int, expert_dim: int,
                        latent_dim: int | None = None, n_shared_experts: int = 0) -> int:
    """Active forward FLOPs per token (2 per multiply-add) of a (latent) MoE layer with GLU experts.

    router 2·d·n  +  [W↓ and W↑: 2·2·d·ℓ]  +  routed 2·k·3·w·h (w = ℓ or d)  +  shared 2·n_s·3·d·h.
    """
    width = latent_dim or d_model
    projections = 2 * d_model * latent_dim if latent_dim else 0
    routed = top_k * 3 * width * expert_dim
    return 2 * (d_model * n_routed_experts + projections + routed + n_shared_experts * 3 * d_model * expert_dim)


def all_to_all_bytes_per_token(d_model: int, top_k: int, latent_dim: int | None = None,
                               bytes_per_value: int = 2) -> int:
    """Bytes a token sends across expert-parallel ranks per MoE layer: dispatch plus combine.

    Dispatch sends the token's expert input to each of its k experts, combine brings k outputs back, each a
    vector of width w = ℓ (latent) or d: 2 · k · w · bytes_per_value (an upper bound: no dedup per rank).
    """
    return 2 * top_k * (latent_dim or d_model) * bytes_per_value
