"""Gated multi-head latent attention (MLA), rung 0: NumPy, one token and one head at a time.

Written to be read next to lesson 09. For one token x ∈ R^d and head h:

    c_Q  = RMSNorm(W_DQ x)                              (q_lora_rank)
    q_h  = W_UQ[h] c_Q = [q_nope_h ; q_rope_h]          (nope + rope)
    [c_KV ; k_rope] = W_DKV x,  c = RMSNorm(c_KV)       (kv_lora_rank + rope)   <- the cache
    k_nope_h = W_UK[h] c,  v_h = W_UV[h] c              (nope), (v)
    score(t, s) = (q_nope_h(t)·k_nope_h(s) + q_rope_h(t)·k_rope(s)) / sqrt(nope + rope),  s ≤ t
    o_h(t) = Σ_s softmax_s(score(t, ·)) v_h(s)
    y = W_O [σ(W_G x) ⊙ concat_h o_h]                   (gate optional)

K3 and Kimi Linear use NoPE: the 64 "rope" dims are never rotated. ``use_rope=True`` rotates them by the
absolute position (half-split RoPE), to show what NoPE leaves out.

``weights`` is a dict of float arrays with the same names and shapes as the torch module
:class:`k3course.layers.mla.GatedMLA`'s ``state_dict()`` (Linear weights are ``[out, in]``):
``q_down.weight [q_rank, d]``, ``q_norm.weight [q_rank]``, ``q_up.weight [H·(nope+rope), q_rank]`` (without
q_down / q_norm, ``q_up.weight [H·(nope+rope), d]``: a full-rank query),
``kv_down.weight [kv_rank + rope, d]``, ``kv_norm.weight [kv_rank]``, ``k_up [H, nope, kv_rank]``,
``v_up [H, v, kv_rank]``, ``gate.weight [H·v, d]`` (gated only), ``out.weight [d, H·v]``.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray | None = None, eps: float = 1e-6) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) ⊙ weight. Shape kept."""
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed if weight is None else normed * weight


def rope_rotate(x: np.ndarray, position: int, theta: float = 10000.0) -> np.ndarray:
    """Rotate the pairs (x[i], x[i + r/2]) of one vector x ∈ R^r by angle position·theta^(-2i/r)."""
    half = x.shape[-1] // 2
    angle = position * theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                           first * np.sin(angle) + second * np.cos(angle)], axis=-1)


def _split_heads(matrix: np.ndarray, n_heads: int, name: str) -> np.ndarray:
    """[H·w, n] -> [H, w, n]; the rows must divide evenly into heads."""
    rows = matrix.shape[0]
    if rows % n_heads:
        raise ValueError(f"{name} has {rows} rows, which do not divide into n_heads={n_heads} heads")
    return matrix.reshape(n_heads, rows // n_heads, matrix.shape[1])


def compress_kv(x: np.ndarray, weights: dict, kv_lora_rank: int, eps: float = 1e-6,
                use_rope: bool = False, start: int = 0) -> np.ndarray:
    """The cache rows of a sequence: [RMSNorm(c_KV) ; k_rope] for each token.

    x: [T, d] -> [T, kv_lora_rank + rope]. ``start`` is the absolute position of x[0] (RoPE only).
    """
    rows = []
    for t in range(x.shape[0]):
        compressed = weights["kv_down.weight"] @ x[t]                       # [kv_rank + rope]
        latent = rms_norm(compressed[:kv_lora_rank], weights["kv_norm.weight"], eps)
        rope_key = compressed[kv_lora_rank:]
        if use_rope:
            rope_key = rope_rotate(rope_key, start + t)
        rows.append(np.concatenate([latent, rope_key]))
    return np.stack(rows)


def queries(x: np.ndarray, weights: dict, n_heads: int, qk_nope_head_dim: int, eps: float = 1e-6,
            use_rope: bool = False, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-head queries through the low-rank path. x: [T, d] -> q_nope [T, H, nope], q_rope [T, H, rope]."""
    q_up = _split_heads(weights["q_up.weight"], n_heads, "q_up.weight")    # [H, nope + rope, q_rank]
    q_nope, q_rope = [], []
    for t in range(x.shape[0]):
        if "q_down.weight" in weights:                                      # low-rank query path
            c_q = rms_norm(weights["q_down.weight"] @ x[t], weights["q_norm.weight"], eps)
        else:                                                               # full-rank query
            c_q = x[t]
        q = q_up @ c_q                                                      # [H, nope + rope]
        rope = q[:, qk_nope_head_dim:]
        if use_rope:
            rope = rope_rotate(rope, start + t)
        q_nope.append(q[:, :qk_nope_head_dim])
        q_rope.append(rope)
    return np.stack(q_nope), np.stack(q_rope)


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, shifted by the max for stability."""
    shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def attend_naive(q_nope: np.ndarray, q_rope: np.ndarray, cache: np.ndarray, weights: dict,
                 start: int = 0) -> np.ndarray:
    """Up-project every cached token, then attend causally. Query t sits at absolute position start + t.

    q_nope [T, H, nope], q_rope [T, H, rope], cache [S, kv_rank + rope] -> o [T, H, v].
    """
    k_up, v_up = weights["k_up"], weights["v_up"]                           # [H, nope, r], [H, v, r]
    kv_rank = k_up.shape[2]
    scale = 1.0 / np.sqrt(q_nope.shape[-1] + q_rope.shape[-1])
    out = np.zeros((q_nope.shape[0], k_up.shape[0], v_up.shape[1]))
    for t in range(q_nope.shape[0]):
        visible = cache[: start + t + 1]                                    # causal: s ≤ start + t
        for h in range(k_up.shape[0]):
            k_nope = visible[:, :kv_rank] @ k_up[h].T                       # [s, nope]
            values = visible[:, :kv_rank] @ v_up[h].T                       # [s, v]
            scores = (k_nope @ q_nope[t, h] + visible[:, kv_rank:] @ q_rope[t, h]) * scale
            out[t, h] = softmax(scores) @ values
    return out


def attend_absorbed(q_nope: np.ndarray, q_rope: np.ndarray, cache: np.ndarray, weights: dict,
                    start: int = 0) -> np.ndarray:
    """Same output as :func:`attend_naive`, attending over the latent cache itself.

    q_nope·(W_UK c) = (W_UKᵀ q_nope)·c, so the query is moved into latent space once per token, and
    Σ_s p_s W_UV c_s = W_UV (Σ_s p_s c_s), so W_UV is applied once to the attended latent.
    """
    k_up, v_up = weights["k_up"], weights["v_up"]
    kv_rank = k_up.shape[2]
    scale = 1.0 / np.sqrt(q_nope.shape[-1] + q_rope.shape[-1])
    out = np.zeros((q_nope.shape[0], k_up.shape[0], v_up.shape[1]))
    for t in range(q_nope.shape[0]):
        visible = cache[: start + t + 1]
        for h in range(k_up.shape[0]):
            q_latent = k_up[h].T @ q_nope[t, h]                             # [r]: absorbed query
            scores = (visible[:, :kv_rank] @ q_latent + visible[:, kv_rank:] @ q_rope[t, h]) * scale
            latent_context = softmax(scores) @ visible[:, :kv_rank]         # [r]
            out[t, h] = v_up[h] @ latent_context                            # [v]
    return out


def gated_mla(x: np.ndarray, weights: dict, n_heads: int, qk_nope_head_dim: int, kv_lora_rank: int,
              gated: bool = True, use_rope: bool = False, absorbed: bool = False, eps: float = 1e-6,
              cache: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One gated-MLA layer on one sequence. x: [T, d] -> (y [T, d], cache [S + T, kv_rank + rope]).

    ``cache`` holds the rows of S earlier tokens; the new tokens sit at positions S, S+1, ...
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [T, d] for the reference rung, got shape {x.shape}")
    start = 0 if cache is None else cache.shape[0]
    new_rows = compress_kv(x, weights, kv_lora_rank, eps, use_rope, start)
    full = new_rows if cache is None else np.concatenate([cache, new_rows])
    q_nope, q_rope = queries(x, weights, n_heads, qk_nope_head_dim, eps, use_rope, start)
    attend = attend_absorbed if absorbed else attend_naive
    heads = attend(q_nope, q_rope, full, weights, start).reshape(x.shape[0], -1)    # [T, H·v]
    if gated:
        gate = 1.0 / (1.0 + np.exp(-(x @ weights["gate.weight"].T)))
        heads = gate * heads
    return heads @ weights["out.weight"].T, full
