"""Plausible wrong answers for chapter 01."""

import torch


def topk_weights_from_biased_scores(scores, k, bias=None, renormalize=True):
    biased = scores if bias is None else scores + bias
    idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = biased.gather(1, idx)  # the bias leaks into the weights
    return idx, weights / weights.sum(-1, keepdim=True) if renormalize else weights


def topk_softmax_over_chosen(scores, k, bias=None, renormalize=True):
    biased = scores if bias is None else scores + bias
    idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :k]
    return idx, torch.softmax(scores.gather(1, idx), -1)


def sort_offsets_as_counts(expert_idx, n_experts):
    flat = expert_idx.reshape(-1)
    return torch.sort(flat, stable=True).indices, torch.bincount(flat, minlength=n_experts).to(torch.int32)


def sort_offsets_as_starts(expert_idx, n_experts):
    flat = expert_idx.reshape(-1)
    counts = torch.bincount(flat, minlength=n_experts)
    return torch.sort(flat, stable=True).indices, (counts.cumsum(0) - counts).to(torch.int32)


def unsort_applies_the_permutation_again(rows_sorted, order):
    return rows_sorted[order]


def aux_soft_fraction(probs, expert_idx, alpha=1.0):
    n = probs.shape[1]
    mean_prob = probs.mean(0)
    return alpha * n * (mean_prob * mean_prob).sum()  # f_j replaced by P_j


def aux_without_n(probs, expert_idx, alpha=1.0):
    n = probs.shape[1]
    fraction = torch.bincount(expert_idx.reshape(-1), minlength=n).to(probs.dtype) / expert_idx.numel()
    return alpha * (fraction * probs.mean(0)).sum()


def sign_rule_wrong_direction(bias, load, gamma):
    return bias + gamma * torch.sign(load - load.float().mean())


def sign_rule_without_sign(bias, load, gamma):
    return bias - gamma * (load - load.float().mean())



def topk_experts_in_index_order(scores, k, bias=None, renormalize=True):
    """The right experts and weights, but each row sorted by expert id (the docstring promises score order)."""
    biased = scores if bias is None else scores + bias
    idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=1).values
    weights = scores.gather(1, idx)
    return idx, weights / weights.sum(-1, keepdim=True) if renormalize else weights


def topk_weights_in_float32(scores, k, bias=None, renormalize=True):
    """Weights cast to float32 whatever the scores' dtype."""
    biased = scores if bias is None else scores + bias
    idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = scores.gather(1, idx).float()
    return idx, weights / weights.sum(-1, keepdim=True) if renormalize else weights


def sort_order_as_input_dtype(expert_idx, n_experts):
    """order in the ids' dtype (int32 ids give an int32 order; indices are int64)."""
    flat = expert_idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices.to(expert_idx.dtype)
    return order, torch.bincount(flat, minlength=n_experts).cumsum(0).to(torch.int32)


def unsort_into_float32_zeros(rows_sorted, order):
    """Scatters into torch.zeros(...) of the default dtype, float32."""
    out = torch.zeros(rows_sorted.shape)
    out[order] = rows_sorted.float()
    return out


def sign_rule_in_place(bias, load, gamma):
    """The right step, applied to the caller's bias in place."""
    bias -= gamma * torch.sign(load.double() - load.double().mean()).to(bias.dtype)
    return bias


def sign_rule_integer_mean(bias, load, gamma):
    """Floor-divides the mean load (wrong whenever the mean is not an integer)."""
    mean = load.sum() // load.numel()
    return bias - gamma * torch.sign(load - mean).to(bias.dtype)


def sign_rule_float32_result(bias, load, gamma):
    """Forgets to cast back: a bfloat16 bias comes back float32."""
    return bias - gamma * torch.sign(load - load.float().mean())


WRONG = {
    "01.topk_route": [topk_weights_from_biased_scores, topk_softmax_over_chosen, topk_experts_in_index_order,
                      topk_weights_in_float32],
    "01.sort_by_expert": [sort_offsets_as_counts, sort_offsets_as_starts, sort_order_as_input_dtype],
    "01.unsort": [unsort_applies_the_permutation_again, unsort_into_float32_zeros],
    "01.switch_aux_loss": [aux_soft_fraction, aux_without_n],
    "01.sign_rule_update": [sign_rule_wrong_direction, sign_rule_without_sign, sign_rule_in_place,
                            sign_rule_integer_mean, sign_rule_float32_result],
}
