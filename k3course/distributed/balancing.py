"""Load balancing across ranks: every rank computes the same bias from statistics pooled by all-reduce.

quantile (K3): each rank's margins s_tj − α_t are histogrammed per expert over edges all ranks agree on
(from the all-reduced min and max), the histograms are summed, and b̂_j = −(the (q+1)-th largest margin of
expert j) is read off the pooled histogram with q = ⌊m k / n⌋, m the tokens of all ranks.
sign rule (DeepSeek-V3): b ← b − γ sign(load − mean load) with load summed over the ranks
(:meth:`k3course.distributed.AllToAllDispatch.pool_counts`).
Integer counts are summed exactly and the edges are the same floats everywhere, so the biases are identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k3course.moe.balancing import HISTOGRAM_BINS, bias_from_histogram, margin_histogram, margin_range


def pooled_margin_edges(scores: torch.Tensor, bias: torch.Tensor, k: int, bins: int, group=None) -> torch.Tensor:
    """edges [bins + 1] float64 spanning [min over ranks of the margins, max over ranks]; a rank may hold no token."""
    low, high = margin_range(scores, bias, k) if scores.shape[0] else (float("inf"), float("-inf"))
    extremes = torch.tensor([-low, high], dtype=torch.float64, device=scores.device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    return torch.linspace(-float(extremes[0]), float(extremes[1]), bins + 1, dtype=torch.float64,
                          device=scores.device)


def pooled_quantile_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, bins: int = HISTOGRAM_BINS,
                         group=None) -> torch.Tensor:
    """Quantile balancing on the tokens of all ranks: scores [m_r, n] (this rank's), bias [n] -> new bias [n].

    Equal on every rank, and within one bin width of the exact quantile step on the concatenated scores.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    edges = pooled_margin_edges(scores, bias, k, bins, group)
    counts = margin_histogram(scores, bias, k, edges)  # [n, bins] int64, this rank's tokens
    dist.all_reduce(counts, group=group)
    tokens = torch.tensor(scores.shape[0], device=scores.device)
    dist.all_reduce(tokens, group=group)
    return bias_from_histogram(counts, edges, int(tokens) * k // scores.shape[1]).to(bias.dtype)

