"""Routing statistics for plots: per-expert load, max-violation and entropy."""

from __future__ import annotations

import math

import torch


def max_violation(load: torch.Tensor) -> float:
    """max_j load_j / mean load − 1: 0 when perfectly balanced, 1 when the busiest expert has twice its share."""
    load = load.to(torch.float64)
    if load.dim() != 1 or load.sum() <= 0:
        raise ValueError(f"load must be a 1-D tensor of counts with a positive sum, got shape {tuple(load.shape)}")
    return float(load.max() / load.mean() - 1)


def load_entropy(load: torch.Tensor) -> float:
    """Entropy of the load fractions, over log n: 1 when perfectly balanced, 0 when one expert takes all."""
    fraction = load.to(torch.float64) / load.sum()
    nonzero = fraction[fraction > 0]
    return float(-(nonzero * nonzero.log()).sum() / math.log(load.numel()))


def load_stats(load: torch.Tensor) -> dict:
    """{'load': [n] counts, 'max_violation': float, 'entropy': float} from per-expert token-slot counts."""
    return {"load": load, "max_violation": max_violation(load), "entropy": load_entropy(load)}


def routing_stats(expert_idx: torch.Tensor, n: int) -> dict:
    """:func:`load_stats` of one batch of routing decisions expert_idx [m, k]."""
    return load_stats(torch.bincount(expert_idx.reshape(-1), minlength=n))
