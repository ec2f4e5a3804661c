"""Chapter 03, the NumPy rung: the quantile balancing bias by sorting margins."""

from __future__ import annotations

import numpy as np

from k3course.grading.registry import NUMPY_ONLY, Case, Exercise, register
from k3course.reference import moe as ref


def quantile_bias_numpy(scores, bias, k):
    """α_t = (k+1)-th largest of s_t + b; b̂_j = −((q+1)-th largest over t of s_tj − α_t), q = ⌊mk/n⌋;
    returns b̂ − mean(b̂). scores [m, n], bias [n] -> [n]."""
    return ref.quantile_balance_bias(scores, bias, k)


def quantile_case(seed: int, m: int, n: int, k: int, bias: float = 0.0, skew: float = 0.0) -> tuple:
    """(scores [m, n] in (0, 1), bias [n], k): router scores, skewed towards the last experts by ``skew``."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((m, n)) + skew * np.linspace(0, 1, n)
    return ref.sigmoid(logits), bias * rng.standard_normal(n), k


def _cases() -> list[Case]:
    return [Case("m=37, n=8, k=2, no bias", quantile_case(1, 37, 8, 2)),
            Case("a skewed router and a bias", quantile_case(2, 50, 6, 2, bias=0.3, skew=3.0)),
            Case("k=1", quantile_case(3, 20, 5, 1)),
            Case("k=n-1", quantile_case(4, 21, 5, 4)),
            Case("m k / n not an integer", quantile_case(5, 13, 6, 3, bias=0.1))]


register(Exercise("03.quantile_bias_numpy", quantile_bias_numpy, _cases, forbidden=NUMPY_ONLY,
                  package=(ref.quantile_balance_bias,)))
