"""An online balancing experiment on a skewed sigmoid router (notebooks 01 and 03, tests).

Each step draws a fresh batch of tokens, routes it with the current bias, records the load, then lets the
balancing rule move the bias; the new bias routes the next batch. The router itself is fixed (no learning), so
the experiment isolates how fast each rule finds the balancing bias.
"""

from __future__ import annotations

import torch

from k3course.moe.balancing import expert_load, quantile_balance_bias, sign_rule_update
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
        """Scores of m fresh tokens: [m, n] float32."""
        x = torch.randn(m, self.d, generator=self.generator)
        return torch.sigmoid(x @ self.weight / self.d**0.5 + self.skew)


def simulate_balancing(rule: str, steps: int, m: int = 4096, n_experts: int = 64, k: int = 4, skew: float = 1.0,
                       gamma: float = 1e-3, seed: int = 0) -> list[float]:
    """Max-violation of each step's routing under ``rule`` ('quantile', 'sign' or 'none').

    Step t routes batch t with the bias from steps < t, so entry 0 is the unbalanced router.
    """
    if rule not in ("quantile", "sign", "none"):
        raise ValueError(f"rule must be 'quantile', 'sign' or 'none', got {rule!r}")
    router = SkewedRouter(n_experts, skew=skew, seed=seed)
    bias = torch.zeros(n_experts)
    violations = []
    for _ in range(steps):
        scores = router.batch(m)
        expert_idx, _ = topk_route(scores, k, bias)
        load = expert_load(expert_idx, n_experts)
        violations.append(max_violation(load))
        if rule == "quantile":
            bias = quantile_balance_bias(scores, bias, k)
        elif rule == "sign":
            bias = sign_rule_update(bias, load, gamma)
    return violations
