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


WRONG = {
    "01.topk_route": [topk_weights_from_biased_scores, topk_softmax_over_chosen],
    "01.sort_by_expert": [sort_offsets_as_counts, sort_offsets_as_starts],
    "01.unsort": [unsort_applies_the_permutation_again],
    "01.switch_aux_loss": [aux_soft_fraction, aux_without_n],
    "01.sign_rule_update": [sign_rule_wrong_direction, sign_rule_without_sign],
}
