"""An online balancing experiment on a skewed sigmoid router (notebooks 01 and 03, tests).

Each step draws a fresh batch of tokens, routes it with the current bias, records the load, then lets the
balancing rule move the bias; the new bias routes the next batch. The router itself is fixed (no learning), so
the experiment isolates how fast each rule finds the balancing bias. The aux_loss rule is the exception: it
has no bias and instead takes SGD steps on the router's own weights with the Switch loss alone (the best case
for it: in training the aux loss competes with the language-model loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3course.config import BALANCING
from k3course.moe.balancing import (
    SIGN_RULE_STEP,
    expert_load,
    quantile_balance_bias,
    sign_rule_update,
    switch_aux_loss,
)
from k3course.moe.routing import topk_route
from k3course.moe.stats import max_violation


class SkewedRouter:
    """Sigmoid router scores s = σ(x W / √d + skew) with a per-expert additive skew (some experts much hotter).

    skew_j = skew · (a standard normal draw per expert), so with skew = 1 the hottest experts' logits sit
    about two units above the coldest. Tokens x ~ N(0, I_d) are drawn fresh by :meth:`batch`.
    """

    def __init__(self, n_experts: int = 64, d: int = 32, skew: float = 1.0, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.d, self.n = d, n_experts
        self.weight = torch.randn(d, n_experts, generator=generator)
        self.skew = skew * torch.randn(n_experts, generator=generator)
        self.generator = generator

    def batch(self, m: int) -> torch.Tensor:
        """Scores of m fresh tokens: [m, n] float32 (differentiable in weight and skew when they require grad)."""
        x = torch.randn(m, self.d, generator=self.generator)
        return torch.sigmoid(x @ self.weight / self.d**0.5 + self.skew)


def _aux_step(router: SkewedRouter, scores: torch.Tensor, expert_idx: torch.Tensor, lr: float) -> None:
    """One SGD step on the router's weight and skew with the Switch loss on normalised sigmoid scores."""
    loss = switch_aux_loss(scores / scores.sum(-1, keepdim=True), expert_idx)
    grad_weight, grad_skew = torch.autograd.grad(loss, (router.weight, router.skew))
    with torch.no_grad():
        router.weight -= lr * grad_weight
        router.skew -= lr * grad_skew


@dataclass
class BalancingRun:
    """One run of :func:`run_balancing`: the max-violation and the per-expert load of every step."""

    violations: list[float]
    loads: torch.Tensor  # [steps, n] int64


def run_balancing(rule: str, steps: int, m: int = 4096, n_experts: int = 64, k: int = 4, skew: float = 1.0,
                  gamma: float = SIGN_RULE_STEP, lr: float = 1.0, seed: int = 0) -> BalancingRun:
    """Route ``steps`` fresh batches under ``rule`` ('quantile', 'sign', 'aux_loss' or 'none'), recording each load.

    Step t routes batch t with the bias (or router) from steps < t, so step 0 is the unbalanced router.
    gamma: the sign rule's step; lr: the aux loss's SGD learning rate.
    """
    if rule not in BALANCING:
        raise ValueError(f"rule must be one of {BALANCING}, got {rule!r}")
    router = SkewedRouter(n_experts, skew=skew, seed=seed)
    router.weight.requires_grad_(rule == "aux_loss")
    router.skew.requires_grad_(rule == "aux_loss")
    bias = torch.zeros(n_experts)
    loads = []
    for _ in range(steps):
        scores = router.batch(m)
        expert_idx, _ = topk_route(scores.detach(), k, bias)
        loads.append(expert_load(expert_idx, n_experts))
        if rule == "quantile":
            bias = quantile_balance_bias(scores.detach(), bias, k)
        elif rule == "sign":
            bias = sign_rule_update(bias, loads[-1], gamma)
        elif rule == "aux_loss":
            _aux_step(router, scores, expert_idx, lr)
    return BalancingRun([max_violation(load) for load in loads], torch.stack(loads))


def simulate_balancing(rule: str, steps: int, **options) -> list[float]:
    """The max-violation of each step of :func:`run_balancing` (same arguments)."""
    return run_balancing(rule, steps, **options).violations
