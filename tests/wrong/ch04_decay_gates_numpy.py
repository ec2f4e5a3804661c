"""Plausible wrong answers for chapter 04's NumPy rung."""

import numpy as np

from k3course.reference import linear_attention as ref


def missing_decay(q, k, v, g, scale=None, initial_state=None):
    """Plain linear attention: the decay factor is never applied."""
    return ref.linear_attention(q, k, v, scale, initial_state)


def forgotten_initial_state(q, k, v, g, scale=None, initial_state=None):
    return ref.decay_linear_attention(q, k, v, g, scale)


def decay_after_write(q, k, v, g, scale=None, initial_state=None):
    """S_t = Diag(α_t)(S_{t-1} + k_t v_tᵀ): the new write is decayed too."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    alpha = np.exp(g if g.ndim == 4 else np.repeat(g[..., None], K, -1))
    state = np.zeros((B, H, K, v.shape[-1])) if initial_state is None else initial_state.copy()
    o = np.zeros(v.shape)
    for t in range(T):
        state = alpha[:, t, :, :, None] * (state + k[:, t, :, :, None] * v[:, t, :, None, :])
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, scale * q[:, t])
    return o, state


def in_float32(q, k, v, g, scale=None, initial_state=None):
    o, state = ref.decay_linear_attention(q, k, v, g, scale, initial_state)
    return o.astype(np.float32), state.astype(np.float32)


WRONG = {"04.decay_recurrence_numpy": [missing_decay, forgotten_initial_state, decay_after_write, in_float32]}
