"""The MoE layers: ``MoE`` (experts at full width) and ``LatentMoE`` (K3's Stable LatentMoE).

    scores s = score_fn(x W_r);  (idx, p) = topk_route(s, k, bias)          router reads full-width x
    u_t = route_scale · Σ_{j ∈ idx_t} p_tj E_j(z_t)
    MoE:        z = x,      y = shared(x) + u
    LatentMoE:  z = x W↓,   y = shared(x) + RMSNorm(u) W↑                   experts run at width ℓ

Dispatch is sort-based: token-slots are sorted by expert, each expert's GEMM runs on its contiguous block
(:func:`k3course.moe.dispatch.grouped_mm`), and the outputs are unsorted and weighted. No loop over tokens.

The selection bias is a buffer. In training mode each forward records the routing it used; the training loop
calls :meth:`MoE.update_bias` after the optimizer step, and the new bias routes the next step. In eval mode
nothing is recorded and the bias is frozen.
"""

from __future__ import annotations

import torch
from torch import nn

from k3course.moe.balancing import expert_load, quantile_balance_bias, router_z_loss, sign_rule_update, switch_aux_loss
from k3course.moe.dispatch import sort_by_expert, unsort
from k3course.moe.experts import GLUFFN, RoutedExperts
from k3course.moe.latent import latent_combine
from k3course.moe.routing import router_scores, topk_route
from k3course.moe.stats import routing_stats

BALANCING = ("quantile", "sign", "aux", None)
ALIASES = {"aux_loss": "aux", "none": None}  # the spellings K3Config uses


class MoE(nn.Module):
    """A routed mixture of experts with optional shared experts and an optional latent projection.

    d_model: width of x; n_routed experts, top_k active per token; n_shared shared experts, fused into one
    GLU FFN of width n_shared · d_expert (K3: 2 shared); d_expert: inner width of each expert;
    d_latent: ℓ, the width the routed experts run at (None: full width, no projection);
    score_fn 'sigmoid' | 'softmax'; activation 'swiglu' | 'situ_glu'; route_scale multiplies the weights;
    balancing 'quantile' | 'sign' | 'aux' | None (K3Config's 'aux_loss' and 'none' are accepted);
    gamma: the sign rule's step; aux_alpha: the aux loss weight.
    x [..., d_model] -> y [..., d_model].
    """

    def __init__(self, d_model: int, n_routed: int, top_k: int, n_shared: int = 0, d_expert: int | None = None,
                 d_latent: int | None = None, score_fn: str = "sigmoid", activation: str = "swiglu",
                 route_scale: float = 1.0, balancing: str | None = "quantile", gamma: float = 1e-3,
                 aux_alpha: float = 1e-2, renormalize: bool = True, eps: float = 1e-6,
                 generator: torch.Generator | None = None, backend: str = "auto"):
        super().__init__()
        if not 1 <= top_k < n_routed:
            raise ValueError(f"top_k must satisfy 1 <= top_k < n_routed = {n_routed}, got {top_k}")
        balancing = ALIASES.get(balancing, balancing)
        if balancing not in BALANCING:
            raise ValueError(f"balancing must be one of {BALANCING}, got {balancing!r}")
        if score_fn not in ("sigmoid", "softmax"):
            raise ValueError(f"score_fn must be 'sigmoid' or 'softmax', got {score_fn!r}")
        if d_latent is not None and not 1 <= d_latent <= d_model:
            raise ValueError(f"d_latent must be None or in [1, d_model = {d_model}], got {d_latent}")
        d_expert = d_expert or d_model
        self.d_model, self.n_routed, self.top_k, self.d_latent = d_model, n_routed, top_k, d_latent
        self.score_fn, self.route_scale, self.balancing = score_fn, route_scale, balancing
        self.renormalize = renormalize
        self.gamma, self.aux_alpha, self.eps = gamma, aux_alpha, eps
        self.router = nn.Parameter(torch.randn(d_model, n_routed, generator=generator) / d_model**0.5)
        self.register_buffer("bias", torch.zeros(n_routed))
        width = d_latent or d_model
        self.experts = RoutedExperts(n_routed, width, d_expert, activation, generator, backend)
        self.shared = GLUFFN(d_model, n_shared * d_expert, activation, generator) if n_shared else None
        if d_latent is not None:
            self.down_proj = nn.Parameter(torch.randn(d_model, d_latent, generator=generator) / d_model**0.5)
            self.up_proj = nn.Parameter(torch.randn(d_latent, d_model, generator=generator) / d_latent**0.5)
            self.latent_norm = nn.Parameter(torch.ones(d_latent))
        self.aux_loss = torch.zeros(())  # the Switch loss of the last training forward (balancing="aux")
        self.z_loss = torch.zeros(())  # the router z-loss of the last training forward (any balancing)
        self.last_scores: torch.Tensor | None = None
        self.last_expert_idx: torch.Tensor | None = None

    @classmethod
    def from_config(cls, cfg, **overrides) -> MoE:
        """The MoE layer of a :class:`k3course.config.K3Config` (its expert, router and balancing fields)."""
        sizes = dict(d_model=cfg.d_model, n_routed=cfg.n_routed_experts, top_k=cfg.top_k,
                     n_shared=cfg.n_shared_experts, d_expert=cfg.expert_dim, d_latent=cfg.latent_dim,
                     score_fn=cfg.router_score, activation=cfg.ffn_activation, route_scale=cfg.route_scale,
                     balancing=cfg.balancing)
        return cls(**{**sizes, **overrides})

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router on full-width x [m, d]: (logits [m, n], scores [m, n], expert_idx [m, k], weights [m, k])."""
        logits = x @ self.router
        scores = router_scores(logits, self.score_fn)
        expert_idx, weights = topk_route(scores, self.top_k, self.bias, self.renormalize)
        return logits, scores, expert_idx, weights

    def expert_outputs(self, z: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """E_{idx_ti}(z_t) for every token-slot, by sort-based dispatch. z [m, w] -> [m, k, w]."""
        m, k = expert_idx.shape
        order, group_offsets = sort_by_expert(expert_idx, self.n_routed)  # [m k], [n]
        z_sorted = z.index_select(0, order // k)  # [m k, w]: row r is the token of slot order[r]
        out_sorted = self.experts(z_sorted, group_offsets)  # [m k, w]
        return unsort(out_sorted, order).view(m, k, -1)  # back in token order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must have last dimension d_model = {self.d_model}, got shape {tuple(x.shape)}")
        if torch.isnan(x).any():
            raise ValueError("x contains NaN")
        flat = x.reshape(-1, self.d_model)  # [m, d]
        logits, scores, expert_idx, weights = self.route(flat)
        weights = self.route_scale * weights
        if self.d_latent is None:
            y = torch.einsum("mk,mkd->md", weights, self.expert_outputs(flat, expert_idx))
        else:
            out_slots = self.expert_outputs(flat @ self.down_proj, expert_idx)  # [m, k, ℓ]
            y = latent_combine(out_slots, weights, self.up_proj, self.latent_norm, self.eps)
        if self.shared is not None:
            y = y + self.shared(flat)
        if self.training:
            self._record(logits, scores, expert_idx)
        return y.view(x.shape)

    def _record(self, logits: torch.Tensor, scores: torch.Tensor, expert_idx: torch.Tensor) -> None:
        """Keep what the balancing rule needs (detached), and the aux loss (with its gradient) when used."""
        self.last_scores, self.last_expert_idx = scores.detach(), expert_idx
        if self.balancing == "aux":
            probs = scores / scores.sum(-1, keepdim=True)
            self.aux_loss = switch_aux_loss(probs, expert_idx, self.aux_alpha)
        self.z_loss = router_z_loss(logits)

    @torch.no_grad()
    def update_bias(self) -> bool:
        """Move the bias by the balancing rule, from the last training forward; True when it changed.

        quantile: b ← quantile_balance_bias(s, b, k); sign: b ← b − γ sign(load − mean load);
        aux / None: the bias stays 0. Does nothing in eval mode or before any training forward.
        """
        if not self.training or self.last_scores is None or self.balancing not in ("quantile", "sign"):
            return False
        if self.balancing == "quantile":
            new_bias = quantile_balance_bias(self.last_scores, self.bias, self.top_k)
        else:
            load = expert_load(self.last_expert_idx, self.n_routed)
            new_bias = sign_rule_update(self.bias, load, self.gamma)
        self.bias.copy_(new_bias)
        self.last_scores = None  # a second call before the next forward must not apply the same batch again
        return True

    def reference_params(self) -> dict:
        """The weights as fp64 NumPy arrays under the names :func:`k3course.reference.moe.moe_forward` reads."""
        as_np = lambda t: t.detach().cpu().double().numpy()
        params = {"router": as_np(self.router), "bias": as_np(self.bias), "w_gate": as_np(self.experts.gate),
                  "w_up": as_np(self.experts.up), "w_down": as_np(self.experts.down)}
        if self.shared is not None:
            params |= {"shared_gate": as_np(self.shared.gate), "shared_up": as_np(self.shared.up),
                       "shared_down": as_np(self.shared.down)}
        if self.d_latent is not None:
            params |= {"w_down_proj": as_np(self.down_proj), "w_up_proj": as_np(self.up_proj),
                       "latent_norm": as_np(self.latent_norm)}
        return params

    def routing_stats(self) -> dict:
        """Load, max-violation and entropy of the last training forward's routing (see :func:`routing_stats`)."""
        if self.last_expert_idx is None:
            raise RuntimeError("routing_stats needs a forward in training mode first")
        return routing_stats(self.last_expert_idx, self.n_routed)


class LatentMoE(MoE):
    """K3's Stable LatentMoE: routed experts run at d_latent = ℓ (default d_model / 2, as in K3).

    y = shared(x) + RMSNorm(Σ_j p_j E_j(x W↓)) W↑; router and shared experts read the full-width x.
    """

    def __init__(self, d_model: int, n_routed: int, top_k: int, n_shared: int = 0, d_expert: int | None = None,
                 d_latent: int | None = None, **kwargs):
        super().__init__(d_model, n_routed, top_k, n_shared, d_expert, d_latent or d_model // 2, **kwargs)
