"""Plausible wrong answers for chapter 06's NumPy rung."""

import numpy as np

from k3course.reference import linear_attention as ref


def one_decay_per_head(q, k, v, g, beta, scale=None, initial_state=None):
    """Averages the channel gate into one rate per head (gated DeltaNet)."""
    return ref.gated_delta_rule(q, k, v, g.mean(-1), beta, scale, initial_state)


def decay_on_the_value_axis(q, k, v, g, beta, scale=None, initial_state=None):
    """Applies Diag(α) to the columns of S (the V axis) instead of its rows (the K axis)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    state = np.zeros((B, H, K, v.shape[-1])) if initial_state is None else initial_state.copy()
    o = np.zeros(v.shape)
    for t in range(T):
        state = state * np.exp(g[:, t])[:, :, None, : v.shape[-1]]
        error = v[:, t] - np.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + beta[:, t, :, None, None] * k[:, t, :, :, None] * error[:, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, scale * q[:, t])
    return o, state


def correction_before_decay(q, k, v, g, beta, scale=None, initial_state=None):
    """S_t = Diag(α_t)[(I − β k kᵀ) S + β k vᵀ]: corrects against the undecayed state, then decays everything."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    state = np.zeros((B, H, K, v.shape[-1])) if initial_state is None else initial_state.copy()
    o = np.zeros(v.shape)
    for t in range(T):
        error = v[:, t] - np.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + beta[:, t, :, None, None] * k[:, t, :, :, None] * error[:, :, None, :]
        state = np.exp(g[:, t])[..., None] * state
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, scale * q[:, t])
    return o, state


def forgotten_initial_state(q, k, v, g, beta, scale=None, initial_state=None):
    return ref.kda(q, k, v, g, beta, scale)


WRONG = {"06.kda_numpy": [one_decay_per_head, decay_on_the_value_axis, correction_before_decay,
                          forgotten_initial_state]}
