"""The MoE layers: ``MoE`` (experts at full width) and ``LatentMoE`` (K3's Stable LatentMoE).

    scores s = score_fn(x W_r);  (idx, p) = topk_route(s, k, bias)          router reads full-width x, in fp32
    u_t = route_scale · Σ_{j ∈ idx_t} p_tj E_j(z_t)
    MoE:        z = x,      y = shared(x) + u
    LatentMoE:  z = x W↓,   y = shared(x) + RMSNorm(u) W↑                   experts run at width ℓ

The layer reaches its experts through a dispatcher (:class:`LocalDispatch` on one process): token-slots are
sorted by expert, each expert's GEMM runs on its contiguous block (:func:`k3course.moe.dispatch.grouped_mm`),
and the outputs are unsorted and weighted. No loop over tokens. Expert parallelism
(:func:`k3course.distributed.parallelize_experts`) swaps the dispatcher, not the layer.

The selection bias is a buffer, moved by the balancing rule between optimizer steps (see :class:`MoE`). Routing
(logits, scores, bias, selection) runs in fp32 whatever the activations' dtype, and the bias stays fp32 when the
layer is cast (``.to(torch.bfloat16)``), as the reference implementations route: in bf16 a score near 0.5 has a
resolution of 2e-3, so smaller biases would vanish and near-ties would pick other experts.
"""

from __future__ import annotations

import torch
from torch import nn

from k3course.debug import profiler_range
from k3course.moe.balancing import (
    AUX_LOSS_WEIGHT,
    SIGN_RULE_STEP,
    quantile_balance_bias,
    router_z_loss,
    sign_rule_update,
    switch_aux_loss,
)
from k3course.moe.dispatch import sort_by_expert, unsort
from k3course.moe.experts import GLUFFN, RoutedExperts, init_weight
from k3course.moe.latent import latent_combine
from k3course.moe.routing import router_scores, topk_route
from k3course.moe.stats import load_statistics
from k3course.ops.norm import NORM_EPS
from k3course.params import no_weight_decay, residual_output
from k3course.parts import part

BALANCING = ("quantile", "sign", "aux", None)
ALIASES = {"aux_loss": "aux", "none": None}  # the spellings K3Config uses


class LocalDispatch:
    """How an :class:`MoE` reaches its routed experts when this process holds all of them (the default).

    Three methods, the contract every dispatcher keeps (:class:`k3course.distributed.AllToAllDispatch` keeps it
    with the experts spread over ranks):

        expert_outputs(experts, z, expert_idx)   E_{idx_ti}(z_t) for every token-slot: sort, bank, unsort
        pool_counts(tokens, load)                (M, load) of all tokens: here this process's own
        quantile_bias(scores, bias, k)           the quantile step on the scores of all tokens: here exact
    """

    def expert_outputs(self, experts: RoutedExperts, z: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """E_{idx_ti}(z_t) for every token-slot, by sort-based dispatch. z [m, w], expert_idx [m, k] -> [m, k, w]."""
        m, k = expert_idx.shape
        order, group_offsets = sort_by_expert(expert_idx, experts.gate_up.shape[0])  # [m k], [n]
        z_sorted = z.index_select(0, order // k)  # [m k, w]: row r is the token of slot order[r]
        out_sorted = experts(z_sorted, group_offsets)  # [m k, w]
        return unsort(out_sorted, order).view(m, k, z.shape[1])  # back in token order

    def pool_counts(self, tokens: int, load: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(M, load [n]) over all tokens: on one process the recorded ones, unchanged."""
        return tokens, load

    def quantile_bias(self, scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
        """:func:`~k3course.moe.quantile_balance_bias` on the scores [M, n] of all tokens -> new bias [n]."""
        return quantile_balance_bias(scores, bias, k)


class MoE(nn.Module):
    """A routed mixture of experts with optional shared experts and an optional latent projection.

    d_model: width of x; n_routed experts, top_k active per token (1 ≤ top_k ≤ n_routed); n_shared shared
    experts, fused into one GLU FFN of width n_shared · d_expert (K3: 2 shared); d_expert: inner width of each
    expert; d_latent: ℓ, the width the routed experts run at (None: full width, no projection);
    score_fn 'sigmoid' | 'softmax'; activation 'swiglu' | 'situ_glu'; route_scale multiplies the weights;
    renormalize: weights over the chosen k sum to 1 (else the raw scores); n_groups, topk_groups: group-limited
    routing (:func:`~k3course.moe.routing.group_limited`, 1 and 1: none);
    balancing 'quantile' | 'sign' | 'aux' | None (K3Config's 'aux_loss' and 'none' are accepted);
    gamma: the sign rule's step; aux_alpha: the aux loss weight; device: where the weights live
    (``"meta"``: shapes only, instant even at K3 size). x [..., d_model] -> y [..., d_model]; zero tokens give
    an empty y.

    Training with A micro-batches per optimizer step (gradient accumulation)::

        for x_j in micro_batches:                        # j = 1 .. A
            y_j = moe(x_j)
            loss_j = task_loss(y_j) + moe.aux_loss + w_z * moe.z_loss   # THIS micro-batch's losses, with grad
            (loss_j / A).backward()
        optimizer.step(); optimizer.zero_grad()
        moe.load_statistics()      # load over all A micro-batches
        moe.update_bias()        # the balancing rule on all A micro-batches, then the record is cleared

    Each training forward adds its routing to a record: per-expert token-slot counts (the sign rule and the
    statistics) and, for quantile balancing, the detached router scores [m_j, n] (the quantile step needs the
    order statistics of all M = Σ_j m_j tokens), written into a preallocated [capacity, n] buffer: fixed shapes,
    so a compiled forward neither recompiles nor grows a list with the micro-batches
    (:meth:`reserve_statistics` sizes it for a step's tokens; it doubles when a step brings more).
    ``aux_loss`` (Switch loss, balancing="aux", else 0) and ``z_loss`` (router z-loss) are replaced at every
    training forward. Eval mode records nothing and the bias
    stays frozen. Expert parallelism reads :meth:`balancing_statistics`, pools it over ranks, sets the bias
    and calls :meth:`reset_statistics`.
    """

    def __init__(self, d_model: int, n_routed: int, top_k: int, n_shared: int = 0, d_expert: int | None = None,
                 d_latent: int | None = None, score_fn: str = "sigmoid", activation: str = "swiglu",
                 route_scale: float = 1.0, balancing: str | None = "quantile", gamma: float = SIGN_RULE_STEP,
                 aux_alpha: float = AUX_LOSS_WEIGHT, renormalize: bool = True, eps: float = NORM_EPS,
                 generator: torch.Generator | None = None, backend: str = "auto",
                 device: torch.device | str | None = None, n_groups: int = 1, topk_groups: int = 1):
        super().__init__()
        if not 1 <= top_k <= n_routed:
            raise ValueError(f"top_k must satisfy 1 <= top_k <= n_routed = {n_routed}, got {top_k}")
        balancing = ALIASES.get(balancing, balancing)
        if balancing not in BALANCING:
            raise ValueError(f"balancing must be one of {BALANCING}, got {balancing!r}")
        if score_fn not in ("sigmoid", "softmax"):
            raise ValueError(f"score_fn must be 'sigmoid' or 'softmax', got {score_fn!r}")
        if d_latent is not None and not 1 <= d_latent <= d_model:
            raise ValueError(f"d_latent must be None or in [1, d_model = {d_model}], got {d_latent}")
        if n_routed % n_groups or not 1 <= topk_groups <= n_groups or top_k > topk_groups * (n_routed // n_groups):
            raise ValueError(f"n_groups must divide n_routed = {n_routed}, topk_groups be in [1, n_groups] and their "
                             f"experts hold top_k = {top_k}; got n_groups = {n_groups}, topk_groups = {topk_groups}")
        d_expert = d_expert or d_model
        self.d_model, self.n_routed, self.top_k, self.d_latent = d_model, n_routed, top_k, d_latent
        self.score_fn, self.route_scale, self.balancing = score_fn, route_scale, balancing
        self.renormalize, self.n_groups, self.topk_groups = renormalize, n_groups, topk_groups
        self.gamma, self.aux_alpha, self.eps = gamma, aux_alpha, eps
        self.router = init_weight((d_model, n_routed), d_model, generator, device)
        self.register_buffer("bias", torch.zeros(n_routed, device=device))
        width = d_latent or d_model
        self.experts = RoutedExperts(n_routed, width, d_expert, activation, generator, backend, device)
        self.shared = GLUFFN(d_model, n_shared * d_expert, activation, generator, device) if n_shared else None
        if d_latent is not None:
            self.down_proj = init_weight((d_model, d_latent), d_model, generator, device)
            self.up_proj = residual_output(init_weight((d_latent, d_model), d_latent, generator, device))
            self.latent_norm = no_weight_decay(nn.Parameter(torch.ones(d_latent, device=device)))
        self.aux_loss = torch.zeros((), device=device)  # Switch loss of the last training forward (balancing="aux")
        self.z_loss = torch.zeros((), device=device)  # router z-loss of the last training forward
        self.register_buffer("recorded_load", torch.zeros(n_routed, dtype=torch.int64, device=device),
                             persistent=False)  # token-slots per expert since the last update
        self.recorded_tokens = 0  # tokens since the last update
        # quantile balancing: the detached scores of the recorded tokens in rows [0, recorded_tokens), a buffer
        # that grows only when a step brings more tokens than it holds (reserve_statistics sizes it up front)
        self.register_buffer("recorded_scores", torch.zeros(0, n_routed, device=device), persistent=False)
        self.dispatcher = LocalDispatch()  # how tokens reach the experts (and how records are pooled)

    @classmethod
    def from_config(cls, cfg, **overrides) -> MoE:
        """The MoE layer of a :class:`k3course.config.K3Config` (its expert, router and balancing fields)."""
        sizes = dict(d_model=cfg.d_model, n_routed=cfg.n_routed_experts, top_k=cfg.top_k,
                     n_shared=cfg.n_shared_experts, d_expert=cfg.expert_dim, d_latent=cfg.latent_dim,
                     score_fn=cfg.router_score, activation=cfg.ffn_activation, route_scale=cfg.route_scale,
                     balancing=cfg.balancing, renormalize=cfg.renormalize_top_k, n_groups=cfg.n_expert_groups,
                     topk_groups=cfg.topk_groups)
        return cls(**{**sizes, **overrides})

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router on full-width x [m, d]: (logits [m, n], scores [m, n], expert_idx [m, k], weights [m, k]);
        logits, scores and weights in fp32 (fp64 for fp64 x) whatever x's dtype. Without expert groups it calls
        ``topk_route`` exactly as chapter 01 writes it, so a learner's version fits (:mod:`k3course.lessons.parts`)."""
        wide = torch.promote_types(x.dtype, torch.float32)
        logits = x.to(wide) @ self.router.to(wide)
        scores = part("router_scores", router_scores)(logits, self.score_fn)
        groups = {} if self.n_groups == 1 else {"n_groups": self.n_groups, "topk_groups": self.topk_groups}
        expert_idx, weights = part("topk_route", topk_route)(scores, self.top_k, self.bias, self.renormalize, **groups)
        return logits, scores, expert_idx, weights

    def _apply(self, fn, recurse=True):
        """``.to``, ``.cuda``, ``.bfloat16`` ... as for any module, except that the selection bias and the recorded
        router scores are never cast below fp32 (``.bfloat16()`` leaves them fp32, ``.double()`` makes them fp64)."""
        kept = {name: getattr(self, name) for name in ("bias", "recorded_scores")}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            if after.dtype != before.dtype:
                setattr(self, name, before.to(after.device, torch.promote_types(after.dtype, torch.float32)))
        return self

    def expert_outputs(self, z: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """E_{idx_ti}(z_t) for every token-slot, through the dispatcher. z [m, w] -> [m, k, w]."""
        return self.dispatcher.expert_outputs(self.experts, z, expert_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = shared(x) + routed(x), x [..., d_model] -> [..., d_model]; records the routing in training.

        Its stages are named profiler ranges (:func:`k3course.debug.profiler_range`, no-ops without a profiler):
        moe.route, moe.down projection (LatentMoE), moe.dispatch (sort, gather, unsort, with the experts' own
        range moe.experts inside), moe.combine and moe.shared. ``k3course bench moe`` reads them.
        """
        self._check_input(x)
        flat = x.reshape(-1, self.d_model)  # [m, d]
        with profiler_range("moe.route"):
            logits, scores, expert_idx, weights = self.route(flat)
        z = flat
        if self.d_latent is not None:
            with profiler_range("moe.down projection"):
                z = flat @ self.down_proj  # [m, ℓ]
        with profiler_range("moe.dispatch"):
            out_slots = self.expert_outputs(z, expert_idx)  # [m, k, w]
        with profiler_range("moe.combine"):
            weights = (self.route_scale * weights).to(x.dtype)  # routing ran in fp32
            if self.d_latent is None:
                y = torch.einsum("mk,mkd->md", weights, out_slots)
            else:
                y = latent_combine(out_slots, weights, self.up_proj, self.latent_norm, self.eps)
        if self.shared is not None:
            with profiler_range("moe.shared"):
                y = y + self.shared(flat)
        if self.training:
            self._record(logits, scores, expert_idx)
        return y.view(x.shape)

    def _check_input(self, x: torch.Tensor) -> None:
        """Shape and dtype only (no value is read: NaN scans belong to the model boundary / k3course.debug)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [..., d_model = {self.d_model}], got {shape}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")

    def _record(self, logits: torch.Tensor, scores: torch.Tensor, expert_idx: torch.Tensor) -> None:
        """This micro-batch's losses (with grad), and its routing added to the record (detached, no host read).

        With zero tokens the losses are 0 (a mean over no tokens would be NaN) and nothing is added.
        """
        m = logits.shape[0]
        if m == 0:
            self.z_loss = self.aux_loss = logits.sum()  # 0, still connected to the router for backward
            return
        self.z_loss = router_z_loss(logits)
        if self.balancing == "aux":
            self.aux_loss = switch_aux_loss(scores / scores.sum(-1, keepdim=True), expert_idx, self.aux_alpha)
        flat = expert_idx.reshape(-1)
        self.recorded_load.scatter_add_(0, flat, torch.ones_like(flat))
        start, end = self.recorded_tokens, self.recorded_tokens + m
        if self.balancing == "quantile":
            if end > self.recorded_scores.shape[0]:
                self.reserve_statistics(max(end, 2 * self.recorded_scores.shape[0]))
            self.recorded_scores[start:end] = scores.detach()
        self.recorded_tokens = end

    def reserve_statistics(self, tokens: int) -> None:
        """Make the quantile record hold ``tokens`` tokens (e.g. one optimizer step's) without growing: call it
        before compiling the model. Recorded rows are kept; a smaller ``tokens`` leaves the buffer as it is."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an int ≥ 0, got {tokens!r}")
        if self.balancing != "quantile" or tokens <= self.recorded_scores.shape[0]:
            return
        grown = self.recorded_scores.new_zeros(tokens, self.n_routed)
        grown[:self.recorded_tokens] = self.recorded_scores[:self.recorded_tokens]
        self.recorded_scores = grown

    def balancing_statistics(self) -> dict:
        """What the balancing rule reads, over the training forwards since the last update (or reset).

        {"tokens": M (int), "load": [n] int64 token-slots per expert (Σ = M·k), "scores": [M, n] detached
        router scores for balancing="quantile", else None}: this process's record (the dispatcher pools it).
        """
        scores = self.recorded_scores[:self.recorded_tokens].clone() if self.balancing == "quantile" else None
        return {"tokens": self.recorded_tokens, "load": self.recorded_load.clone(), "scores": scores}

    def reset_statistics(self) -> None:
        """Clear the record (the training loop's :meth:`update_bias` does this after using it)."""
        self.recorded_load.zero_()
        self.recorded_tokens = 0

    @torch.no_grad()
    def update_bias(self) -> bool:
        """Move the bias by the balancing rule on every micro-batch since the last update, then clear the record.

        quantile: b ← quantile_balance_bias(s, b, k) on the scores s [M, n] of all M recorded tokens;
        sign: b ← b − γ sign(load − mean load) on the summed load; aux / None: the bias stays 0.
        The statistics are pooled by the dispatcher: on one process they are the record itself; with parallel
        experts, load and M are all-reduced and the quantile read off all-reduced margin histograms, so every
        rank sets the same bias. Returns True when the bias moved. In eval mode, or with no token recorded
        (on any rank), nothing moves (False).
        """
        if not self.training:
            return False
        statistics = self.balancing_statistics()
        self.reset_statistics()
        tokens, load = self.dispatcher.pool_counts(statistics["tokens"], statistics["load"])
        if tokens == 0 or self.balancing not in ("quantile", "sign"):
            return False
        if self.balancing == "quantile":
            self.bias.copy_(self.dispatcher.quantile_bias(statistics["scores"], self.bias, self.top_k))
        else:
            self.bias.copy_(sign_rule_update(self.bias, load, self.gamma))
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

    def load_statistics(self) -> dict:
        """Load, max-violation and entropy of the routing recorded since the last update (all micro-batches, and
        with parallel experts all ranks: the dispatcher pools the counts).

        {'load': [n] counts, 'max_violation': float, 'entropy': float, 'tokens': int}; see
        :func:`k3course.moe.stats.load_statistics`.
        """
        tokens, load = self.dispatcher.pool_counts(self.recorded_tokens, self.recorded_load.clone())
        if tokens == 0:
            raise RuntimeError("load_statistics needs a forward in training mode since the last update_bias()")
        return {**load_statistics(load), "tokens": tokens}


class LatentMoE(MoE):
    """K3's Stable LatentMoE: routed experts run at d_latent = ℓ (default d_model / 2, as in K3).

    y = shared(x) + RMSNorm(Σ_j p_j E_j(x W↓)) W↑; router and shared experts read the full-width x.
    """

    def __init__(self, d_model: int, n_routed: int, top_k: int, n_shared: int = 0, d_expert: int | None = None,
                 d_latent: int | None = None, **kwargs):
        super().__init__(d_model, n_routed, top_k, n_shared, d_expert, d_latent or d_model // 2, **kwargs)
