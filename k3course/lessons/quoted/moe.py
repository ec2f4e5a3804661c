"""Chapters 02 and 03: latent MoE, and the sampling floor of balancing on fresh batches. Each function is a number a
lesson quotes (see :mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

import math

from k3course.lessons.quoted.markers import quoted
from k3course.lessons.quoted.size import k3_config


@quoted
def expert_work_vs_projections(which: str) -> int:
    """K3's per-token routed-expert width K·3h ("experts") against the projections' 2d ("projections")."""
    cfg = k3_config()
    return cfg.top_k * 3 * cfg.expert_dim if which == "experts" else 2 * cfg.d_model

@quoted
def quota(m: int = 4096, n: int = 64, k: int = 4) -> int:
    """An expert's fair share of m tokens' k choices over n experts: ⌊m·k/n⌋ token-slots."""
    return m * k // n


@quoted
def quota_sd(m: int = 4096, n: int = 64, k: int = 4) -> float:
    """The standard deviation of one expert's load around its quota, ≈ √q (a Poisson-like count)."""
    return math.sqrt(quota(m, n, k))


@quoted
def expected_max_normal(count: int = 64) -> float:
    """E[max of ``count`` independent standard normals], by numerical integration."""
    step, total, x = 1e-3, 0.0, -10.0
    while x < 10.0:
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * count * cdf ** (count - 1) * pdf * step
        x += step
    return total


@quoted
def sampling_floor(batches: int = 1, m: int = 4096, n: int = 64, k: int = 4) -> float:
    """The max-violation left by sampling noise: the largest of n loads sits E[max z]·√(batches·q) above q,
    relative to q (``batches`` = 2 when the bias carries its own batch's noise too)."""
    q = quota(m, n, k)
    return expected_max_normal(n) * math.sqrt(batches * q) / q


@quoted
def histogram_kib(n: int = 64, bins: int = 256, count_bytes: int = 8) -> float:
    """The per-expert margin histograms one all-reduce sums (int64 counters, as ``torch.bincount`` returns), KiB."""
    return n * bins * count_bytes / 2**10
