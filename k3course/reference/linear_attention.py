"""Rung 0 of the linear-attention track: NumPy, float64, one loop over time (lessons 04–06).

Every rule keeps a state ``S`` of shape ``[K, V]`` per head and reads it with the query, ``o_t = S_tᵀ q_t``.
The rules differ only in how the state is updated from one token to the next:

=================  ==============================================================
linear attention   S_t = S_{t-1} + k_t v_tᵀ
decay (scalar)     S_t = α_t S_{t-1} + k_t v_tᵀ                 (α_t one number per head)
decay (channel)    S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ           (GLA: α_t ∈ (0, 1)^K)
delta rule         S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
gated DeltaNet     S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
KDA                S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ
=================  ==============================================================

Layouts follow fla's: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, log-decay ``g = log α`` either
``[B, T, H]`` (scalar) or ``[B, T, H, K]`` (channel), ``beta`` ``[B, T, H]``, state ``[B, H, K, V]``. The query
is multiplied by ``scale`` (default ``K ** -0.5``). Each function returns ``(o, final_state)``.
"""

from __future__ import annotations

import numpy as np


def _setup(q, v, scale, initial_state):
    """float64 copies of the shared pieces: scaled q, the starting state and an empty output."""
    q = np.asarray(q, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    batch, _, heads, key_dim = q.shape
    scale = key_dim ** -0.5 if scale is None else scale
    state = np.zeros((batch, heads, key_dim, v.shape[-1]))
    if initial_state is not None:
        state = state + np.asarray(initial_state, dtype=np.float64)
    return q * scale, v, state, np.zeros(v.shape)


def _channel_decay(g, key_dim):
    """exp(g) as ``[B, T, H, K]``: a scalar gate ``[B, T, H]`` is repeated over the K channels."""
    g = np.asarray(g, dtype=np.float64)
    if g.ndim == 3:
        g = np.repeat(g[..., None], key_dim, axis=-1)
    return np.exp(g)


def linear_attention(q, k, v, scale=None, initial_state=None):
    """S_t = S_{t-1} + k_t v_tᵀ;  o_t = S_tᵀ (scale·q_t).  Returns ``(o [B,T,H,V], S [B,H,K,V])``."""
    q, v, state, o = _setup(q, v, scale, initial_state)
    k = np.asarray(k, dtype=np.float64)
    for t in range(q.shape[1]):
        state = state + np.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return o, state


def decay_linear_attention(q, k, v, g, scale=None, initial_state=None):
    """S_t = Diag(e^{g_t}) S_{t-1} + k_t v_tᵀ;  o_t = S_tᵀ (scale·q_t).

    ``g`` is ``[B, T, H]`` (one decay per head, RetNet/Mamba2-style) or ``[B, T, H, K]`` (GLA, per channel).
    """
    q, v, state, o = _setup(q, v, scale, initial_state)
    k = np.asarray(k, dtype=np.float64)
    alpha = _channel_decay(g, q.shape[-1])  # [B, T, H, K]
    for t in range(q.shape[1]):
        state = alpha[:, t, :, :, None] * state + np.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return o, state


def _delta_update(state, k_t, v_t, beta_t):
    """(I − β k kᵀ) S + β k vᵀ = S + β k (v − Sᵀk)ᵀ: one SGD step on ½‖Sᵀk − v‖² with step size β."""
    error = v_t - np.einsum("bhkv,bhk->bhv", state, k_t)  # [B, H, V]: what the state gets wrong about k
    return state + beta_t[..., None, None] * np.einsum("bhk,bhv->bhkv", k_t, error)


def delta_rule(q, k, v, beta, scale=None, initial_state=None):
    """S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ;  o_t = S_tᵀ (scale·q_t)."""
    q, v, state, o = _setup(q, v, scale, initial_state)
    k, beta = np.asarray(k, dtype=np.float64), np.asarray(beta, dtype=np.float64)
    for t in range(q.shape[1]):
        state = _delta_update(state, k[:, t], v[:, t], beta[:, t])
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return o, state


def gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None):
    """Gated DeltaNet: S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ, α_t = e^{g_t}, g ``[B, T, H]``.

    The scalar α commutes with (I − β k kᵀ), so decaying first and then correcting is the same rule.
    """
    q, v, state, o = _setup(q, v, scale, initial_state)
    k, beta = np.asarray(k, dtype=np.float64), np.asarray(beta, dtype=np.float64)
    alpha = np.exp(np.asarray(g, dtype=np.float64))  # [B, T, H]
    for t in range(q.shape[1]):
        state = _delta_update(alpha[:, t, :, None, None] * state, k[:, t], v[:, t], beta[:, t])
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return o, state


def kda(q, k, v, g, beta, scale=None, initial_state=None):
    """Kimi Delta Attention: S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ, α_t = e^{g_t}.

    ``g`` is ``[B, T, H, K]``: each key channel forgets at its own rate. Decay first, then the delta
    correction against the decayed state.
    """
    q, v, state, o = _setup(q, v, scale, initial_state)
    k, beta = np.asarray(k, dtype=np.float64), np.asarray(beta, dtype=np.float64)
    alpha = _channel_decay(g, q.shape[-1])  # [B, T, H, K]
    for t in range(q.shape[1]):
        state = _delta_update(alpha[:, t, :, :, None] * state, k[:, t], v[:, t], beta[:, t])
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return o, state


def decay_attention_parallel(q, k, v, g, scale=None):
    """The parallel (attention-like) form of decayed linear attention from a zero state:

    o_t = Σ_{s ≤ t} (Σ_d q_td k_sd e^{G_td − G_sd}) v_s,  G = cumsum(g) over time.

    Quadratic in T, but no loop over time: the form that shows linear attention is masked attention with
    a decay mask in place of the softmax.
    """
    q = np.asarray(q, dtype=np.float64)
    k, v = np.asarray(k, dtype=np.float64), np.asarray(v, dtype=np.float64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    log_decay = np.cumsum(np.log(_channel_decay(g, q.shape[-1])), axis=1)  # G: [B, T, H, K]
    diff = log_decay[:, :, None] - log_decay[:, None, :]  # [B, T(t), T(s), H, K]
    causal = np.tril(np.ones((q.shape[1], q.shape[1]), dtype=bool))[None, :, :, None, None]
    weights = np.where(causal, np.exp(np.minimum(diff, 0.0)), 0.0)  # e^{G_t − G_s} for s ≤ t
    scores = np.einsum("bthd,bshd,btshd->bhts", q * scale, k, weights)
    return np.einsum("bhts,bshv->bthv", scores, v)
