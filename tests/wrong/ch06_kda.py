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


def kda_output_scaled_q(state, q, k, v, g, beta):
    """Reads o with q / √K, as the layer's attention would: kda_step's q comes unscaled."""
    decayed = g.exp().unsqueeze(-1) * state
    state = decayed + (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - _read(decayed, k)).unsqueeze(-2)
    return _read(state, q * q.shape[-1] ** -0.5), state


def kda_output_from_the_old_state(state, q, k, v, g, beta):
    """o = S_{t-1}ᵀ q_t: reads the state before this token's decay and write."""
    decayed = g.exp().unsqueeze(-1) * state
    new = decayed + (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - _read(decayed, k)).unsqueeze(-2)
    return _read(state, q), new


def kda_the_package_own(state, q, k, v, g, beta):
    """The package's own kda_step, through k3course.ops's re-export."""
    from k3course.ops import kda_step

    return kda_step(state, q, k, v, g, beta)


def kda_through_kda_recurrent(state, q, k, v, g, beta):
    """The package's kda_recurrent on a one-token sequence: it runs the package's kda_step inside."""
    from k3course.ops import kda_recurrent

    o, new = kda_recurrent(*(x.unsqueeze(1) for x in (q, k, v, g, beta)), scale=1.0, initial_state=state,
                           output_final_state=True)
    return o.squeeze(1), new


def short_conv_the_package_own(x, weight, cache=None):
    """The package's own short_conv."""
    from k3course.layers import kda

    return kda.short_conv(x, weight, cache)


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
    """Pads with zeros even when the previous inputs are given (the returned cache is right)."""
    width = weight.shape[-1]
    zeros = x.new_zeros(x.shape[0], width - 1, x.shape[-1])
    y = F.conv1d(torch.cat([zeros, x], 1).transpose(1, 2), weight.unsqueeze(1), groups=x.shape[-1]).transpose(1, 2)
    seen = torch.cat([zeros if cache is None else cache, x], dim=1)
    return y, seen[:, seen.shape[1] - (width - 1):]



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
    "06.kda_step": [kda_decay_after_delta, kda_one_rate_per_head, kda_normalises_keys, kda_output_scaled_q,
                    kda_output_from_the_old_state, kda_the_package_own, kda_through_kda_recurrent],
    "06.kda_gate": [gate_unbounded_always, gate_without_exp, gate_naive_softplus],
    "06.short_conv": [conv_not_causal, conv_ignoring_cache, conv_zeros_in_float32, short_conv_the_package_own],
}

# What the check's message says, for the wrong answers the grader knows the step of (tests/test_grading.py).
POINTED = {
    kda_decay_after_delta: "wrong with no incoming state (S = 0) under a decay: decay the old state first",
    kda_output_scaled_q: "wrong already with g = 0 and β = 0 (S is only read): check the output o_t = S_tᵀ q_t",
    kda_output_from_the_old_state: "wrong with β = 0 (S only decays): check the decay",
    kda_the_package_own: "called the package's own k3course.ops.recurrent.kda_step",
    kda_through_kda_recurrent: "called the package's own k3course.ops.recurrent.kda_step",
    short_conv_the_package_own: "called the package's own k3course.layers.kda.short_conv",
}
