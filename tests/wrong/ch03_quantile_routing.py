"""Plausible wrong answers for chapter 03."""

import torch


def cutoff_kth_not_k_plus_first(scores, bias, k):
    return (scores + bias).sort(dim=1, descending=True).values[:, k - 1]


def cutoff_from_unbiased_scores(scores, bias, k):
    return scores.sort(dim=1, descending=True).values[:, k]


def _margins(scores, bias, k):
    cutoff = (scores + bias).double().sort(dim=1, descending=True).values[:, k]
    return scores.double() - cutoff[:, None]


def quantile_over_experts_axis(scores, bias, k):
    m, n = scores.shape
    margins = _margins(scores, bias, k)
    kth = margins.sort(dim=1, descending=True).values[:, (m * k) // n % n]  # per token, not per expert
    new_bias = -kth[:n]
    return (new_bias - new_bias.mean()).to(bias.dtype)


def quantile_not_mean_centred(scores, bias, k):
    m, n = scores.shape
    return (-_margins(scores, bias, k).sort(dim=0, descending=True).values[(m * k) // n]).to(bias.dtype)


def quantile_interpolated(scores, bias, k):
    m, n = scores.shape
    new_bias = -torch.quantile(_margins(scores, bias, k), 1 - ((m * k) // n + 1) / m, dim=0)
    return (new_bias - new_bias.mean()).to(bias.dtype)


def quantile_margins_on_biased_scores(scores, bias, k):
    m, n = scores.shape
    margins = _margins(scores, bias, k) + bias.double()
    new_bias = -margins.sort(dim=0, descending=True).values[(m * k) // n]
    return (new_bias - new_bias.mean()).to(bias.dtype)


def histogram_counted_from_the_bottom(counts, edges, target):
    bin_index = (counts.cumsum(1) > target).to(torch.int64).argmax(1)
    new_bias = -((edges[:-1] + edges[1:]).double() / 2)[bin_index]
    return new_bias - new_bias.mean()


def histogram_qth_not_q_plus_first(counts, edges, target):
    bins = counts.shape[1]
    top_bin = bins - 1 - (counts.flip(1).cumsum(1) >= target).to(torch.int64).argmax(1)
    new_bias = -((edges[:-1] + edges[1:]).double() / 2)[top_bin]
    return new_bias - new_bias.mean()


def violation_max_over_min(load):
    load = load.double()
    return float(load.max() / load.min().clamp(min=1) - 1)



def cutoff_in_float32(scores, bias, k):
    """The right cutoff, cast to float32."""
    return (scores + bias).float().sort(dim=1, descending=True).values[:, k]


def quantile_returns_float64(scores, bias, k):
    """Computes in float64 as asked, but forgets to return bias.dtype."""
    m, n = scores.shape
    new_bias = -_margins(scores, bias, k).sort(dim=0, descending=True).values[(m * k) // n]
    return new_bias - new_bias.mean()


def histogram_assumes_equal_bins(counts, edges, target):
    """Midpoints as edges[0] + (i + ½)·width: right only when every bin has the same width."""
    bins = counts.shape[1]
    top_bin = bins - 1 - (counts.flip(1).cumsum(1) > target).to(torch.int64).argmax(1)
    width = (edges[-1] - edges[0]).double() / bins
    new_bias = -(edges[0].double() + (top_bin.double() + 0.5) * width)
    return new_bias - new_bias.mean()


def histogram_in_edges_dtype(counts, edges, target):
    """Midpoints in the edges' dtype: float32 edges give a float32 bias."""
    bins = counts.shape[1]
    top_bin = bins - 1 - (counts.flip(1).cumsum(1) > target).to(torch.int64).argmax(1)
    new_bias = -((edges[:-1] + edges[1:]) / 2)[top_bin]
    return new_bias - new_bias.mean()


def violation_integer_mean(load):
    """Floor-divides the mean load."""
    return float(load.max() / (load.sum() // load.numel()) - 1)


WRONG = {
    "03.token_cutoffs": [cutoff_kth_not_k_plus_first, cutoff_from_unbiased_scores, cutoff_in_float32],
    "03.quantile_balance_bias": [quantile_over_experts_axis, quantile_not_mean_centred, quantile_interpolated,
                                 quantile_margins_on_biased_scores, quantile_returns_float64],
    "03.bias_from_histogram": [histogram_counted_from_the_bottom, histogram_qth_not_q_plus_first,
                               histogram_assumes_equal_bins, histogram_in_edges_dtype],
    "03.max_violation": [violation_max_over_min, violation_integer_mean],
}
