"""The MoE router: scores from full-width x, then top-k selection on the biased scores.

    logits = x W_r;  s = router_score(logits);  (idx, p) = topk_route(s, k, b)    in fp32 whatever x's dtype

:class:`Router` holds the routing settings and runs these three steps; the weight W_r [d, n] and the selection
bias b [n] stay on the :class:`~k3course.moe.MoE` that owns them (their checkpoint names are ``router`` and
``bias``). ``router_scores`` and ``topk_route`` are called once each, through the registry :mod:`k3course.parts`
(the functions of :mod:`k3course.moe.routing` unless a learner's chapter-01 versions are in use).
"""

from __future__ import annotations

import torch

from k3course.config import ROUTER_SCORES
from k3course.moe.routing import router_scores, topk_route
from k3course.parts import part


class Router:
    """Token-choice top-k routing over n_routed_experts experts, top_k per token (1 ≤ top_k ≤ n_routed_experts).

    router_score 'sigmoid' | 'softmax'; renormalize: the chosen k weights sum to 1 (else the raw scores);
    n_expert_groups, topk_groups: group-limited routing (:func:`~k3course.moe.routing.group_limited`; 1 and 1:
    none).
    """

    def __init__(self, n_routed_experts: int, top_k: int, router_score: str = "sigmoid", renormalize: bool = True,
                 n_expert_groups: int = 1, topk_groups: int = 1):
        if not 1 <= top_k <= n_routed_experts:
            raise ValueError(f"top_k must satisfy 1 <= top_k <= n_routed_experts = {n_routed_experts}, got {top_k}")
        if router_score not in ROUTER_SCORES:
            raise ValueError(f"router_score must be one of {ROUTER_SCORES}, got {router_score!r}")
        groups, kept = n_expert_groups, topk_groups
        if n_routed_experts % groups or not 1 <= kept <= groups or top_k > kept * (n_routed_experts // groups):
            raise ValueError(f"n_expert_groups must divide n_routed_experts = {n_routed_experts}, topk_groups be in "
                             f"[1, n_expert_groups] and their experts hold top_k = {top_k}; got n_expert_groups = "
                             f"{groups}, topk_groups = {kept}")
        self.n_routed_experts, self.top_k, self.router_score = n_routed_experts, top_k, router_score
        self.renormalize, self.n_expert_groups, self.topk_groups = renormalize, n_expert_groups, topk_groups

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [m, d], weight W_r [d, n], bias [n] -> (logits [m, n], scores [m, n], expert_idx [m, k],
        weights [m, k]); logits, scores and weights in fp32 (fp64 for fp64 x) whatever x's dtype. Without
        expert groups ``topk_route`` is called exactly as chapter 01 writes it."""
        wide = torch.promote_types(x.dtype, torch.float32)
        logits = x.to(wide) @ weight.to(wide)
        scores = part("router_scores", router_scores)(logits, self.router_score)
        groups = {} if self.n_expert_groups == 1 else {"n_expert_groups": self.n_expert_groups,
                                                       "topk_groups": self.topk_groups}
        route = part("topk_route", topk_route)
        expert_idx, weights = route(scores, self.top_k, bias, self.renormalize, **groups)
        return logits, scores, expert_idx, weights
