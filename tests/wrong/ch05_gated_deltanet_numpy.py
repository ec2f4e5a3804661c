"""Plausible wrong answers for chapter 05's NumPy rung."""

import numpy as np

from k3course.reference import linear_attention as ref


def forgotten_initial_state(q, k, v, g, beta, scale=None, initial_state=None):
    return ref.gated_delta_rule(q, k, v, g, beta, scale)


def missing_decay(q, k, v, g, beta, scale=None, initial_state=None):
    """The plain delta rule: the decay factor is never applied."""
    return ref.delta_rule(q, k, v, beta, scale, initial_state)


def decay_after_update(q, k, v, g, beta, scale=None, initial_state=None):
    """S_t = α_t [(I − β k kᵀ) S + β k vᵀ]: the write is decayed too."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    state = np.zeros((B, H, K, v.shape[-1])) if initial_state is None else initial_state.copy()
    o = np.zeros(v.shape)
    for t in range(T):
        error = v[:, t] - np.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + beta[:, t, :, None, None] * k[:, t, :, :, None] * error[:, :, None, :]
        state = np.exp(g[:, t])[:, :, None, None] * state
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, scale * q[:, t])
    return o, state


def in_float32(q, k, v, g, beta, scale=None, initial_state=None):
    return tuple(x.astype(np.float32) for x in ref.gated_delta_rule(q, k, v, g, beta, scale, initial_state))


WRONG = {"05.gated_delta_numpy": [forgotten_initial_state, missing_decay, decay_after_update, in_float32]}
