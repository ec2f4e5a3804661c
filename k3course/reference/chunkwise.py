"""Rung 1 of the KDA track: the chunkwise form in NumPy, float64, one chunk and one head at a time (lesson 07).

The recurrence of :func:`k3course.reference.linear_attention.kda` over a chunk of C tokens, with the state S
entering it, written as matrix products (G the in-chunk inclusive cumsum of g, Γ = e^G, rows are tokens):

1. G = cumsum(g) within the chunk.
2. A_kk[r, i] = β_r Σ_d k_rd k_id e^{G_rd − G_id} for i < r (0 elsewhere).
3. UT transform: M = (I + A_kk)^{-1} Diag(β), row by row by forward substitution.
4. W = M (Γ ⊙ K), U = M V.
5. Ṽ = U − W S.
6. A_qk[r, i] = Σ_d q_rd k_id e^{G_rd − G_id} for i ≤ r.
7. O = (Γ ⊙ Q) S + A_qk Ṽ.
8. S ← Diag(Γ_last) S + (K ⊙ e^{G_last − G})ᵀ Ṽ.

The last chunk may be shorter than C. No exponent here is positive, so nothing overflows for any g ≤ 0.
Layouts as in :mod:`k3course.reference.linear_attention`; returns ``(o, final_state)``.
"""

from __future__ import annotations

import numpy as np


def ut_transform(A_kk: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """M = (I + A_kk)^{-1} Diag(β) by forward substitution: row r of M is β_r e_r − Σ_{i<r} A_kk[r, i] M_i.

    A_kk [C, C] strictly lower triangular, beta [C] -> M [C, C] (lower triangular)."""
    M = np.zeros_like(A_kk)
    for r in range(A_kk.shape[0]):
        M[r, r] = beta[r]
        M[r] -= A_kk[r, :r] @ M[:r]
    return M


def decayed_scores(a: np.ndarray, b: np.ndarray, G: np.ndarray, strict: bool) -> np.ndarray:
    """[r, i] = Σ_d a_rd b_id e^{G_rd − G_id} for i < r (strict) or i ≤ r, 0 above. a, b, G [C, K] -> [C, C]."""
    C = a.shape[0]
    scores = np.zeros((C, C))
    for r in range(C):
        for i in range(r if strict else r + 1):
            scores[r, i] = np.sum(a[r] * b[i] * np.exp(G[r] - G[i]))
    return scores


def kda_chunk_step(q, k, v, g, beta, state):
    """Steps 1–8 for one chunk of one head: q, k, g [C, K], v [C, V], beta [C], state [K, V] -> (o [C, V], S)."""
    G = np.cumsum(g, axis=0)
    M = ut_transform(beta[:, None] * decayed_scores(k, k, G, strict=True), beta)
    W, U = M @ (np.exp(G) * k), M @ v
    v_new = U - W @ state
    o = (np.exp(G) * q) @ state + decayed_scores(q, k, G, strict=False) @ v_new
    state = np.exp(G[-1])[:, None] * state + (k * np.exp(G[-1] - G)).T @ v_new
    return o, state


def kda_chunkwise(q, k, v, g, beta, chunk_size=64, scale=None, initial_state=None):
    """KDA over a sequence, chunk by chunk: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] ->
    (o [B, T, H, V], final state [B, H, K, V]). Equal to the recurrence for any chunk size."""
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    q = q * (K ** -0.5 if scale is None else scale)
    state = np.zeros((B, H, K, v.shape[-1]))
    if initial_state is not None:
        state = state + np.asarray(initial_state, dtype=np.float64)
    o = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            for start in range(0, T, chunk_size):
                span = slice(start, min(start + chunk_size, T))
                o[b, span, h], state[b, h] = kda_chunk_step(q[b, span, h], k[b, span, h], v[b, span, h],
                                                            g[b, span, h], beta[b, span, h], state[b, h])
    return o, state
