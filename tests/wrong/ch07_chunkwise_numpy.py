"""Plausible wrong answers for chapter 07's NumPy rung."""

import numpy as np

from k3course.reference import chunkwise as ref


def drops_the_short_last_chunk(q, k, v, g, beta, chunk_size, initial_state=None):
    """Loops over T // chunk_size whole chunks: a short last chunk is never computed."""
    T = q.shape[1]
    whole = T - T % chunk_size
    o = np.zeros(v.shape)
    o[:, :whole], state = ref.kda_chunkwise(q[:, :whole], k[:, :whole], v[:, :whole], g[:, :whole],
                                            beta[:, :whole], chunk_size, initial_state=initial_state)
    return o, state


def forgotten_initial_state(q, k, v, g, beta, chunk_size, initial_state=None):
    return ref.kda_chunkwise(q, k, v, g, beta, chunk_size)


def state_passed_without_decay(q, k, v, g, beta, chunk_size, initial_state=None):
    """Step 8 without Diag(Γ_last): the entering state is carried into the next chunk undecayed."""
    B, T, H, K = q.shape
    q = q * K ** -0.5
    state = np.zeros((B, H, K, v.shape[-1])) if initial_state is None else initial_state.copy()
    o = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            for start in range(0, T, chunk_size):
                s = slice(start, start + chunk_size)
                kk, gg = k[b, s, h], np.cumsum(g[b, s, h], axis=0)
                M = ref.ut_transform(beta[b, s, h, None] * ref.decayed_scores(kk, kk, gg, True), beta[b, s, h])
                v_new = M @ v[b, s, h] - M @ (np.exp(gg) * kk) @ state[b, h]
                o[b, s, h] = (np.exp(gg) * q[b, s, h]) @ state[b, h] + ref.decayed_scores(q[b, s, h], kk, gg,
                                                                                            False) @ v_new
                state[b, h] = state[b, h] + (kk * np.exp(gg[-1] - gg)).T @ v_new
    return o, state


def in_float32(q, k, v, g, beta, chunk_size, initial_state=None):
    o, state = ref.kda_chunkwise(q, k, v, g, beta, chunk_size, initial_state=initial_state)
    return o.astype(np.float32), state.astype(np.float32)


WRONG = {"07.kda_chunkwise_numpy": [drops_the_short_last_chunk, forgotten_initial_state, state_passed_without_decay,
                                    in_float32]}
