"""Plausible wrong answers for chapter 03's NumPy rung."""

import numpy as np


def _bias(scores, bias, k, cutoff_rank, target_shift=0, centre=True):
    m, n = scores.shape
    cutoff = -np.sort(-(scores + bias), axis=1)[:, cutoff_rank]
    margins = -np.sort(-(scores - cutoff[:, None]), axis=0)  # each expert's margins, largest first
    new = -margins[(m * k) // n + target_shift]
    return new - new.mean() if centre else new


def cutoff_is_the_kth(scores, bias, k):
    """α_t = the k-th largest (the last chosen) instead of the (k+1)-th (the first left out)."""
    return _bias(scores, bias, k, k - 1)


def target_off_by_one(scores, bias, k):
    """Takes the q-th largest margin instead of the (q+1)-th."""
    return _bias(scores, bias, k, k, target_shift=-1)


def not_centred(scores, bias, k):
    """Forgets to subtract the mean."""
    return _bias(scores, bias, k, k, centre=False)


def margins_sorted_over_experts(scores, bias, k):
    """Sorts each token's margins (axis 1) instead of each expert's (axis 0)."""
    m, n = scores.shape
    cutoff = -np.sort(-(scores + bias), axis=1)[:, k]
    margins = -np.sort(-(scores - cutoff[:, None]), axis=1)
    new = -margins[(m * k) // n % m, :]
    return new - new.mean()


WRONG = {"03.quantile_bias_numpy": [cutoff_is_the_kth, target_off_by_one, not_centred, margins_sorted_over_experts]}
