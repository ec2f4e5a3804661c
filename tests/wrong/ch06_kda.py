"""Plausible wrong answers for chapter 06."""

import torch
import torch.nn.functional as F


def _read(state, x):
    return torch.einsum("bhkv,bhk->bhv", state, x)


def kda_decay_after_delta(state, q, k, v, g, beta):
    """Delta update against the old state, then the channel decay (the order swapped)."""
    state = state + (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - _read(state, k)).unsqueeze(-2)
    state = g.exp().unsqueeze(-1) * state
    return _read(state, q), state


def kda_one_rate_per_head(state, q, k, v, g, beta):
    """GDN's scalar decay (the mean rate over the channels) instead of one rate per channel."""
    decayed = g.mean(-1).exp()[..., None, None] * state
    state = decayed + (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - _read(decayed, k)).unsqueeze(-2)
    return _read(state, q), state


def gate_unbounded_always(z, A_log, dt_bias, lower_bound=-5.0):
    """Kimi Linear's gate whatever lower_bound says."""
    return -A_log.exp()[:, None] * F.softplus(z + dt_bias)


def gate_without_exp(z, A_log, dt_bias, lower_bound=-5.0):
    """Uses A_log as the rate itself, not e^{A_log}."""
    if lower_bound is None:
        return -A_log[:, None] * F.softplus(z + dt_bias)
    return lower_bound * torch.sigmoid(A_log[:, None] * (z + dt_bias))


def conv_not_causal(x, weight, cache=None):
    """'same' padding: each output also sees the next inputs."""
    width = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=width // 2, groups=x.shape[-1])
    y = y[..., : x.shape[1]].transpose(1, 2)
    tail = x[:, -(width - 1):] if x.shape[1] >= width - 1 else x
    return y, tail


def conv_ignoring_cache(x, weight, cache=None):
    """Pads with zeros even when the previous inputs are given."""
    from k3course.attention.kda import short_conv

    y, _ = short_conv(x, weight)
    _, tail = short_conv(x, weight, cache)
    return y, tail


WRONG = {
    "06.kda_step": [kda_decay_after_delta, kda_one_rate_per_head],
    "06.kda_gate": [gate_unbounded_always, gate_without_exp],
    "06.short_conv": [conv_not_causal, conv_ignoring_cache],
}
