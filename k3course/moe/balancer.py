"""The MoE's balancing state: the routing record of the training forwards since the last update, and the rule
that turns it into a new selection bias between optimizer steps.

    record(logits, scores, idx)   per micro-batch: z-loss and Switch loss (with grad), load and scores (detached)
    new_bias(bias, dispatcher)    per optimizer step: quantile or sign rule on the record pooled by the dispatcher

The bias itself is the owning :class:`~k3course.moe.MoE`'s buffer (checkpoint name ``bias``); the record is not
saved (non-persistent buffers). Records and bias stay fp32 (or wider) when the layer is cast.
"""

from __future__ import annotations

import torch
from torch import nn

from k3course.config import BALANCING
from k3course.guards import is_number
from k3course.moe.balancing import AUX_LOSS_WEIGHT, SIGN_RULE_STEP, router_z_loss, sign_rule_update, switch_aux_loss
from k3course.moe.stats import load_statistics, load_violation


def keep_fp32(module: nn.Module, fn, recurse: bool, names: tuple[str, ...]) -> None:
    """Apply ``fn`` (``.to``, ``.cuda``, ``.bfloat16`` ...) to ``module`` as nn.Module._apply does, except that
    its tensors ``names`` are never cast below fp32 (``.bfloat16()`` leaves them fp32, ``.double()`` makes them
    fp64)."""
    kept = {name: getattr(module, name) for name in names}
    nn.Module._apply(module, fn, recurse)
    for name, before in kept.items():
        after = getattr(module, name)
        if after.dtype != before.dtype:
            setattr(module, name, before.to(after.device, torch.promote_types(after.dtype, torch.float32)))


class Balancer(nn.Module):
    """The record a balancing rule reads and the rule: ``balancing`` 'quantile' (K3) | 'sign' (DeepSeek-V3) |
    'aux_loss' (Switch: a loss, the bias stays 0) | 'none'; gamma: the sign rule's step; aux_alpha: the Switch
    loss weight; n_routed_experts, top_k: the router's.

    Each training forward adds its routing: per-expert token-slot counts (the sign rule and the statistics) and,
    for quantile balancing, the detached router scores [m_j, n] (the quantile step needs the order statistics of
    all M = Σ_j m_j tokens), written into a preallocated [capacity, n] buffer: fixed shapes, so a compiled
    forward neither recompiles nor grows a list with the micro-batches (:meth:`reserve` sizes it for a step's
    tokens; it doubles when a step brings more).
    """

    def __init__(self, n_routed_experts: int, top_k: int, balancing: str = "quantile", gamma: float = SIGN_RULE_STEP,
                 aux_alpha: float = AUX_LOSS_WEIGHT, device: torch.device | str | None = None):
        super().__init__()
        if balancing not in BALANCING:
            raise ValueError(f"balancing must be one of {BALANCING}, got {balancing!r}")
        self.n_routed_experts, self.top_k = n_routed_experts, top_k
        self.balancing, self.gamma, self.aux_alpha = balancing, gamma, aux_alpha
        self.register_buffer("recorded_load", torch.zeros(n_routed_experts, dtype=torch.int64, device=device),
                             persistent=False)  # token-slots per expert since the last update
        self.recorded_tokens = 0  # tokens since the last update
        self.pending = False  # a training forward recorded since the last update (on every rank alike)
        self.last_violation: torch.Tensor | None = None  # max-violation of the record the last update used
        # quantile balancing: the detached scores of the recorded tokens in rows [0, recorded_tokens), a buffer
        # that grows only when a step brings more tokens than it holds (reserve sizes it up front)
        self.register_buffer("recorded_scores", torch.zeros(0, n_routed_experts, device=device), persistent=False)
        self.pooled: tuple[int, torch.Tensor] | None = None  # (M, load) of the record over all ranks, once pooled

    def _apply(self, fn, recurse=True):
        """As for any module, except that the recorded scores stay fp32 or wider (see :func:`keep_fp32`)."""
        keep_fp32(self, fn, recurse, ("recorded_scores",))
        return self

    def record(self, logits: torch.Tensor, scores: torch.Tensor,
               expert_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This micro-batch's (z-loss, Switch loss or None) with grad, and its routing added to the record
        (detached, no host read). logits, scores [m, n], expert_idx [m, k].

        With zero tokens the losses are 0 (a mean over no tokens would be NaN) and nothing is added. Every call
        drops the pooled counts (on every rank alike, zero tokens included, so the ranks pool again together).
        """
        self.pooled = None
        self.pending = True
        m = logits.shape[0]
        if m == 0:
            zero = logits.sum()  # 0, still connected to the router for backward
            return zero, zero
        aux_loss = None
        if self.balancing == "aux_loss":
            aux_loss = switch_aux_loss(scores / scores.sum(-1, keepdim=True), expert_idx, self.aux_alpha)
        flat = expert_idx.reshape(-1)
        self.recorded_load.scatter_add_(0, flat, torch.ones_like(flat))
        start, end = self.recorded_tokens, self.recorded_tokens + m
        if self.balancing == "quantile":
            if end > self.recorded_scores.shape[0]:
                self.reserve(max(end, 2 * self.recorded_scores.shape[0]))
            self.recorded_scores[start:end] = scores.detach()
        self.recorded_tokens = end
        return router_z_loss(logits), aux_loss

    def reserve(self, tokens: int) -> None:
        """Make the quantile record hold ``tokens`` tokens without growing. Recorded rows are kept; a smaller
        ``tokens`` leaves the buffer as it is."""
        if not is_number(tokens) or tokens < 0:
            raise ValueError(f"tokens must be an int ≥ 0, got {tokens!r}")
        if self.balancing != "quantile" or tokens <= self.recorded_scores.shape[0]:
            return
        grown = self.recorded_scores.new_zeros(tokens, self.n_routed_experts)
        grown[:self.recorded_tokens] = self.recorded_scores[:self.recorded_tokens]
        self.recorded_scores = grown

    def statistics(self) -> dict:
        """{"tokens": M (int), "load": [n] int64 token-slots per expert (Σ = M·k), "scores": [M, n] detached
        router scores for balancing="quantile", else None}: this process's record."""
        scores = self.recorded_scores[:self.recorded_tokens].clone() if self.balancing == "quantile" else None
        return {"tokens": self.recorded_tokens, "load": self.recorded_load.clone(), "scores": scores}

    def reset(self) -> None:
        """Clear the record."""
        self.recorded_load.zero_()
        self.recorded_tokens = 0
        self.pooled = None
        self.pending = False

    def pooled_counts(self, dispatcher) -> tuple[int, torch.Tensor]:
        """(M, load [n]) of the record over all ranks, pooled by ``dispatcher`` once per record: the statistics
        and the rule of one step share one reduction."""
        if self.pooled is None:
            self.pooled = dispatcher.pool_counts(self.recorded_tokens, self.recorded_load.clone())
        return self.pooled

    @torch.no_grad()
    def new_bias(self, bias: torch.Tensor, dispatcher) -> torch.Tensor | None:
        """The rule on the record pooled by ``dispatcher`` (M and the load in one reduction, shared with
        :meth:`load_statistics`), then the record is cleared, its max-violation kept in ``last_violation``
        (None when the record holds no token). quantile: ``dispatcher.quantile_bias`` on the scores of all M
        tokens; sign: b − γ sign(load − mean load). None when nothing moves (aux_loss, none, or no token on any
        rank)."""
        tokens, load = self.pooled_counts(dispatcher)
        self.last_violation = load_violation(load) if tokens else None
        scores = self.statistics()["scores"]
        self.reset()
        if tokens == 0 or self.balancing not in ("quantile", "sign"):
            return None
        if self.balancing == "quantile":
            return dispatcher.quantile_bias(scores, bias, self.top_k, tokens)
        return sign_rule_update(bias, load, self.gamma)

    def load_statistics(self, dispatcher) -> dict:
        """{'load', 'max_violation', 'entropy', 'tokens'} of the record pooled by ``dispatcher``
        (:func:`k3course.moe.stats.load_statistics`)."""
        tokens, load = self.pooled_counts(dispatcher)
        if tokens == 0:
            raise RuntimeError("load_statistics needs a forward in training mode since the last update_bias()")
        return {**load_statistics(load.clone()), "tokens": tokens}

    def max_violation(self, dispatcher) -> torch.Tensor:
        """max_j load_j / mean load − 1 of the record pooled by ``dispatcher``, as a 0-d float64 tensor on the
        record's device (:func:`k3course.moe.stats.load_violation`): no host read, for the training step."""
        tokens, load = self.pooled_counts(dispatcher)
        if tokens == 0:
            raise RuntimeError("max_violation needs a forward in training mode since the last update_bias()")
        return load_violation(load)
