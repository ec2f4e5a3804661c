"""The MoE layers: ``MoE`` (experts at full width) and ``LatentMoE`` (K3's Stable LatentMoE).

    scores s = router_score(x W_r);  (idx, p) = topk_route(s, k, bias)      router reads full-width x, in fp32
    u_t = route_scale · Σ_{j ∈ idx_t} p_tj E_j(z_t)
    MoE:        z = x,      y = shared(x) + u
    LatentMoE:  z = x W↓,   y = shared(x) + RMSNorm(u) W↑                   experts run at width ℓ

``MoE`` composes three parts: a :class:`~k3course.moe.router.Router` (scores, top-k, groups), the experts
(:class:`~k3course.moe.experts.RoutedExperts` and the shared :class:`~k3course.moe.experts.GLUFFN`) and a
:class:`~k3course.moe.balancer.Balancer` (the routing record and the rule that moves the bias). It owns the
tensors under their checkpoint names: ``router`` (W_r), ``bias``, ``experts.*``, ``shared.*``, ``down_proj``,
``up_proj``, ``latent_norm``.

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
from k3course.moe.balancer import Balancer, keep_fp32
from k3course.moe.balancing import AUX_LOSS_WEIGHT, SIGN_RULE_STEP
from k3course.moe.dispatch import LocalDispatch
from k3course.moe.experts import GLUFFN, RoutedExperts, init_weight
from k3course.moe.latent import latent_combine
from k3course.moe.router import Router
from k3course.ops.norm import NORM_EPS
from k3course.params import no_weight_decay, residual_output


class MoE(nn.Module):
    """A routed mixture of experts with optional shared experts and an optional latent projection.

    d_model: width of x; n_routed_experts experts, top_k active per token (1 ≤ top_k ≤ n_routed_experts);
    n_shared_experts shared experts, fused into one GLU FFN of width n_shared_experts · expert_dim (K3: 2);
    expert_dim: inner width of each expert; latent_dim: ℓ, the width the routed experts run at (None: full width,
    no projection); router_score 'sigmoid' | 'softmax'; activation 'swiglu' | 'situ_glu'; route_scale multiplies
    the weights; renormalize: weights over the chosen k sum to 1 (else the raw scores); n_expert_groups,
    topk_groups: group-limited routing (:func:`~k3course.moe.routing.group_limited`, 1 and 1: none);
    balancing 'quantile' | 'sign' | 'aux_loss' | 'none' (K3Config's); gamma: the sign rule's step; aux_alpha:
    the aux loss weight; kernels: the experts' kernel backend (:func:`k3course.kernels.kernel_backend`); device: where
    the weights live (``"meta"``: shapes only, instant even at K3 size). x [..., d_model] -> y [..., d_model];
    zero tokens give an empty y. The names are :class:`k3course.config.K3Config`'s (:meth:`from_config`).

    Training with A micro-batches per optimizer step (gradient accumulation)::

        for x_j in micro_batches:                        # j = 1 .. A
            y_j = moe(x_j)
            loss_j = task_loss(y_j) + moe.aux_loss + w_z * moe.z_loss   # THIS micro-batch's losses, with grad
            (loss_j / A).backward()
        optimizer.step(); optimizer.zero_grad()
        moe.load_statistics()      # load over all A micro-batches
        moe.update_bias()        # the balancing rule on all A micro-batches, then the record is cleared

    Each training forward adds its routing to the balancer's record (:class:`~k3course.moe.balancer.Balancer`;
    :meth:`reserve_statistics` sizes it for a step's tokens before compiling). ``aux_loss`` (Switch loss,
    balancing="aux_loss", else 0) and ``z_loss`` (router z-loss) are replaced at every training forward. Eval
    mode records nothing and the bias stays frozen. Expert parallelism swaps the dispatcher, which pools the
    record over ranks.
    """

    def __init__(self, d_model: int, n_routed_experts: int, top_k: int, n_shared_experts: int = 0,
                 expert_dim: int | None = None, latent_dim: int | None = None, router_score: str = "sigmoid",
                 activation: str = "swiglu", route_scale: float = 1.0, balancing: str = "quantile",
                 gamma: float = SIGN_RULE_STEP, aux_alpha: float = AUX_LOSS_WEIGHT, renormalize: bool = True,
                 eps: float = NORM_EPS, generator: torch.Generator | None = None, kernels: str | None = None,
                 device: torch.device | str | None = None, n_expert_groups: int = 1, topk_groups: int = 1):
        super().__init__()
        if latent_dim is not None and not 1 <= latent_dim <= d_model:
            raise ValueError(f"latent_dim must be None or in [1, d_model = {d_model}], got {latent_dim}")
        self.routing = Router(n_routed_experts, top_k, router_score, renormalize, n_expert_groups, topk_groups)
        self.balancer = Balancer(n_routed_experts, top_k, balancing, gamma, aux_alpha, device)
        expert_dim = expert_dim or d_model
        self.d_model, self.n_routed_experts, self.top_k, self.latent_dim = d_model, n_routed_experts, top_k, latent_dim
        self.route_scale, self.eps = route_scale, eps
        self.router = init_weight((d_model, n_routed_experts), d_model, generator, device)
        self.register_buffer("bias", torch.zeros(n_routed_experts, device=device))
        width = latent_dim or d_model
        self.experts = RoutedExperts(n_routed_experts, width, expert_dim, activation, generator, kernels,
                                     device)
        self.shared = (GLUFFN(d_model, n_shared_experts * expert_dim, activation, generator, device)
                       if n_shared_experts else None)
        if latent_dim is not None:
            self.down_proj = init_weight((d_model, latent_dim), d_model, generator, device)
            self.up_proj = residual_output(init_weight((latent_dim, d_model), latent_dim, generator, device))
            self.latent_norm = no_weight_decay(nn.Parameter(torch.ones(latent_dim, device=device)))
        self.aux_loss = torch.zeros((), device=device)  # Switch loss of the last training forward (aux_loss rule)
        self.z_loss = torch.zeros((), device=device)  # router z-loss of the last training forward
        self.dispatcher = LocalDispatch()  # how tokens reach the experts (and how records are pooled)

    @classmethod
    def from_config(cls, cfg, **overrides) -> MoE:
        """The MoE layer of a :class:`k3course.config.K3Config` (its expert, router and balancing fields; the latent
        RMSNorm takes ``norm_eps``)."""
        fields = ("d_model", "n_routed_experts", "top_k", "n_shared_experts", "expert_dim", "latent_dim",
                  "router_score", "route_scale", "balancing", "n_expert_groups", "topk_groups")
        sizes = {name: getattr(cfg, name) for name in fields}
        sizes |= dict(activation=cfg.ffn_activation, renormalize=cfg.renormalize_top_k, eps=cfg.norm_eps)
        return cls(**{**sizes, **overrides})

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router on full-width x [m, d]: (logits [m, n], scores [m, n], expert_idx [m, k], weights [m, k])
        in fp32 (fp64 for fp64 x) whatever x's dtype (:class:`~k3course.moe.router.Router`)."""
        return self.routing(x, self.router, self.bias)

    def _apply(self, fn, recurse=True):
        """``.to``, ``.cuda``, ``.bfloat16`` ... as for any module, except that the selection bias is never cast
        below fp32 (``.bfloat16()`` leaves it fp32, ``.double()`` makes it fp64)."""
        keep_fp32(self, fn, recurse, ("bias",))
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
        if self.latent_dim is not None:
            with profiler_range("moe.down projection"):
                z = flat @ self.down_proj  # [m, ℓ]
        with profiler_range("moe.dispatch"):
            out_slots = self.expert_outputs(z, expert_idx)  # [m, k, w]
        with profiler_range("moe.combine"):
            weights = (self.route_scale * weights).to(x.dtype)  # routing ran in fp32
            if self.latent_dim is None:
                y = torch.einsum("mk,mkd->md", weights, out_slots)
            else:
                y = latent_combine(out_slots, weights, self.up_proj, self.latent_norm, self.eps)
        if self.shared is not None:
            with profiler_range("moe.shared"):
                y = y + self.shared(flat)
        if self.training:
            self.z_loss, aux_loss = self.balancer.record(logits, scores, expert_idx)
            self.aux_loss = self.aux_loss if aux_loss is None else aux_loss
        return y.view(x.shape)

    def _check_input(self, x: torch.Tensor) -> None:
        """Shape and dtype only (no value is read: NaN scans belong to the model boundary / k3course.debug)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [..., d_model = {self.d_model}], got {shape}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")

    def reserve_statistics(self, tokens: int) -> None:
        """Make the quantile record hold ``tokens`` tokens (e.g. one optimizer step's) without growing: call it
        before compiling the model. Recorded rows are kept; a smaller ``tokens`` leaves the buffer as it is."""
        self.balancer.reserve(tokens)

    def balancing_statistics(self) -> dict:
        """What the balancing rule reads, over the training forwards since the last update (or reset).

        {"tokens": M (int), "load": [n] int64 token-slots per expert (Σ = M·k), "scores": [M, n] detached
        router scores for balancing="quantile", else None}: this process's record (the dispatcher pools it).
        """
        return self.balancer.statistics()

    def reset_statistics(self) -> None:
        """Clear the record (the training loop's :meth:`update_bias` does this after using it)."""
        self.balancer.reset()

    @torch.no_grad()
    def update_bias(self) -> bool:
        """Move the bias by the balancing rule on every micro-batch since the last update, then clear the record.

        quantile: b ← quantile_balance_bias(s, b, k) on the scores s [M, n] of all M recorded tokens;
        sign: b ← b − γ sign(load − mean load) on the summed load; aux_loss / none: the bias stays 0.
        The statistics are pooled by the dispatcher: on one process they are the record itself; with parallel
        experts, load and M are all-reduced and the quantile read off all-reduced margin histograms, so every
        rank sets the same bias. Returns True when the bias moved. In eval mode, or with no token recorded
        (on any rank), nothing moves (False).
        """
        if not self.training:
            return False
        new_bias = self.balancer.new_bias(self.bias, self.dispatcher)
        if new_bias is None:
            return False
        self.bias.copy_(new_bias)
        return True

    def reference_params(self) -> dict:
        """The weights as fp64 NumPy arrays under the names :func:`k3course.reference.moe.moe_forward` reads."""
        as_np = lambda t: t.detach().cpu().double().numpy()
        params = {"router": as_np(self.router), "bias": as_np(self.bias), "w_gate": as_np(self.experts.gate),
                  "w_up": as_np(self.experts.up), "w_down": as_np(self.experts.down)}
        if self.shared is not None:
            params |= {"shared_gate": as_np(self.shared.gate), "shared_up": as_np(self.shared.up),
                       "shared_down": as_np(self.shared.down)}
        if self.latent_dim is not None:
            params |= {"w_down_proj": as_np(self.down_proj), "w_up_proj": as_np(self.up_proj),
                       "latent_norm": as_np(self.latent_norm)}
        return params

    def load_statistics(self) -> dict:
        """Load, max-violation and entropy of the routing recorded since the last update (all micro-batches, and
        with parallel experts all ranks: the dispatcher pools the counts).

        {'load': [n] counts, 'max_violation': float, 'entropy': float, 'tokens': int}; see
        :func:`k3course.moe.stats.load_statistics`.
        """
        return self.balancer.load_statistics(self.dispatcher)


class LatentMoE(MoE):
    """K3's Stable LatentMoE: routed experts run at latent_dim = ℓ (default d_model / 2, as in K3).

    y = shared(x) + RMSNorm(Σ_j p_j E_j(x W↓)) W↑; router and shared experts read the full-width x.
    """

    def __init__(self, d_model: int, n_routed_experts: int, top_k: int, n_shared_experts: int = 0,
                 expert_dim: int | None = None, latent_dim: int | None = None, **kwargs):
        super().__init__(d_model, n_routed_experts, top_k, n_shared_experts, expert_dim, latent_dim or d_model // 2,
                         **kwargs)
