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
    from k3course.layers.kda import short_conv

    y, _ = short_conv(x, weight)
    _, tail = short_conv(x, weight, cache)
    return y, tail



def kda_normalises_keys(state, q, k, v, g, beta):
    """Normalises k inside the step: right for unit keys only."""
    k = F.normalize(k, dim=-1)
    decayed = g.exp().unsqueeze(-1) * state
    state = decayed + (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - _read(decayed, k)).unsqueeze(-2)
    return _read(state, q), state


def gate_naive_softplus(z, A_log, dt_bias, lower_bound=-5.0):
    """softplus as log(1 + e^x): inf for x > 88 in fp32."""
    rate = A_log.exp()[:, None]
    if lower_bound is None:
        return -rate * torch.log(1 + torch.exp(z + dt_bias))
    return lower_bound * torch.sigmoid(rate * (z + dt_bias))


def conv_zeros_in_float32(x, weight, cache=None):
    """Pads with torch.zeros(...) of the default dtype: float64 inputs get a float32 result."""
    width = weight.shape[-1]
    if cache is None:
        cache = torch.zeros(x.shape[0], width - 1, x.shape[-1])
    padded = torch.cat([cache.float(), x.float()], dim=1)
    y = F.conv1d(padded.transpose(1, 2), weight.float().unsqueeze(1), groups=x.shape[-1]).transpose(1, 2)
    return y, padded[:, padded.shape[1] - (width - 1):]


WRONG = {
    "06.kda_step": [kda_decay_after_delta, kda_one_rate_per_head, kda_normalises_keys],
    "06.kda_gate": [gate_unbounded_always, gate_without_exp, gate_naive_softplus],
    "06.short_conv": [conv_not_causal, conv_ignoring_cache, conv_zeros_in_float32],
}
