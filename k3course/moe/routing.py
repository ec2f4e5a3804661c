"""Routing: scores from router logits, and top-k selection with a bias that steers selection only.

1 ≤ k ≤ n everywhere (k = n sends every token to every expert). The checks here read shapes and dtypes only;
NaN scans read values back to the host, so they run only under :func:`k3course.debug.value_checks`.
"""

from __future__ import annotations

import torch

from k3course import debug
from k3course.guards import is_number


def _check_scores(scores: torch.Tensor, name: str = "scores") -> None:
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 2:
        raise ValueError(f"{name} must have shape [m tokens, n experts], got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {scores.dtype}")
    if debug.enabled() and torch.isnan(scores).any():
        raise ValueError(f"{name} contains NaN")


def _check_k(k: int, n: int, name: str = "k") -> None:
    if not is_number(k):
        raise TypeError(f"{name} must be an int, got {type(k).__name__}")
    if not 1 <= k <= n:
        raise ValueError(f"{name} must satisfy 1 <= {name} <= n experts = {n}, got {name} = {k}")


def _check_bias(bias: torch.Tensor, n: int) -> None:
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be a tensor of shape [n experts] = ({n},), got {shape}")
    if debug.enabled() and torch.isnan(bias).any():
        raise ValueError("bias contains NaN")


def router_scores(logits: torch.Tensor, router_score: str = "sigmoid") -> torch.Tensor:
    """s = σ(logits) (K3, DeepSeek-V3) or softmax(logits) over experts (Switch, Mixtral). [m, n] -> [m, n]."""
    if router_score == "sigmoid":
        return torch.sigmoid(logits)
    if router_score == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"router_score must be 'sigmoid' or 'softmax', got {router_score!r}")


def topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest entries of each row, largest first; ties go to the lower expert index.

    ``torch.topk`` does not promise which of several equal entries it picks, so it runs on keys that are
    all different and order like (value, −index):
        key_tj = 2³² · bits(x_tj) + (n − 1 − j)
    where bits maps a float32 to an int32 of the same order (sign flip of the magnitude bits for negative
    values; −0 is made +0 first). One top-k on int64 keys, no host read. fp64 values take a stable sort.
    values [m, n] -> [m, k] int64.
    """
    if values.dtype == torch.float64:
        return torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]
    bits = (values.float() + 0.0).view(torch.int32)  # bf16 / fp16 widen exactly; + 0.0 turns −0 into +0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order == float order
    n = values.shape[1]
    lower_first = torch.arange(n - 1, -1, -1, device=values.device)
    keys = (ordered.long() << 32) | lower_first  # [m, n] int64, all different within a row
    return torch.topk(keys, k, dim=1).indices


def group_limited(biased: torch.Tensor, n_expert_groups: int, topk_groups: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: the n experts form ``n_expert_groups`` equal groups, each token keeps the
    ``topk_groups`` groups whose two best biased scores sum highest (ties: lower group first) and masks the
    experts of the other groups to −inf.

    biased [m, n] (scores + bias), n divisible by n_expert_groups -> [m, n], the masked entries −inf.
    """
    m, n = biased.shape
    if n % n_expert_groups or not 1 <= topk_groups <= n_expert_groups:
        raise ValueError(f"n_expert_groups must divide n experts = {n} and topk_groups be in [1, n_expert_groups = "
                         f"{n_expert_groups}], got n_expert_groups = {n_expert_groups}, topk_groups = {topk_groups}")
    grouped = biased.view(m, n_expert_groups, n // n_expert_groups)
    group_scores = grouped.topk(min(2, n // n_expert_groups), dim=-1).values.sum(-1)  # [m, n_expert_groups]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, topk_indices(group_scores, topk_groups), True)
    return grouped.masked_fill(~kept[:, :, None], float("-inf")).view(m, n)


def topk_route(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None, renormalize: bool = True,
               n_expert_groups: int = 1, topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose k experts per token on s + b; weight them with the unbiased scores.

    idx_t = TopK_j(s_tj + b_j)   (ties: lower index first), among the experts of the best ``topk_groups`` of
            ``n_expert_groups`` groups when n_expert_groups > 1 (:func:`group_limited`)
    p_tj = s_tj / Σ_{i ∈ idx_t} s_ti   (renormalize=True)   or   p_tj = s_tj   (renormalize=False)

    The bias never enters the weights, so it gets no gradient; the router learns through p only.
    scores [m, n] float, bias [n] or None -> (expert_idx [m, k] int64, weights [m, k] scores.dtype).
    """
    _check_scores(scores)
    n = scores.shape[1]
    _check_k(k, n)
    biased = scores.detach()
    if bias is not None:
        _check_bias(bias, n)
        biased = biased + bias.detach().to(scores.dtype)
    if n_expert_groups > 1:
        kept = topk_groups * (n // n_expert_groups)  # experts in the kept groups
        if k > kept:
            raise ValueError(f"k = {k} exceeds the {kept} experts of topk_groups groups")
        biased = group_limited(biased, n_expert_groups, topk_groups)
    expert_idx = topk_indices(biased, k)  # [m, k]
    weights = scores.gather(1, expert_idx)  # [m, k], from the UNBIASED scores
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return expert_idx, weights
