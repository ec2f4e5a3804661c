"""Statistics of an expert load, for plots and the training log: max-violation and entropy.

One vocabulary: the *load* is the token-slot count per expert, [n] int64 (:func:`k3course.moe.expert_load` of
one batch's expert_idx, or an MoE layer's record); :func:`load_statistics` summarises it.
"""

from __future__ import annotations

import math

import torch


def max_violation(load: torch.Tensor) -> float:
    """max_j load_j / mean load − 1: 0 when perfectly balanced, 1 when the busiest expert has twice its share."""
    if load.dim() != 1 or load.sum() <= 0:
        raise ValueError(f"load must be a 1-D tensor of counts with a positive sum, got shape {tuple(load.shape)}")
    return float(load_violation(load))


def load_violation(load: torch.Tensor) -> torch.Tensor:
    """:func:`max_violation` of load [n] as a 0-d float64 tensor on load's device, unchecked: nothing is read back
    to the host (the training step's record; a zero load gives NaN)."""
    load = load.to(torch.float64)
    return load.max() / load.mean() - 1


def load_entropy(load: torch.Tensor) -> float:
    """Entropy of the load fractions, over log n: 1 when perfectly balanced, 0 when one expert takes all."""
    fraction = load.to(torch.float64) / load.sum()
    nonzero = fraction[fraction > 0]
    return float(-(nonzero * nonzero.log()).sum() / math.log(load.numel()))


def load_statistics(load: torch.Tensor) -> dict:
    """{'load': [n] counts, 'max_violation': float, 'entropy': float} of per-expert token-slot counts load [n]."""
    return {"load": load, "max_violation": max_violation(load), "entropy": load_entropy(load)}
