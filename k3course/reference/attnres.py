"""Attention residuals, rung 0: NumPy, written to be read (lesson 10).

A stack of L sub-layers f_1 … f_L (attention and MLP alternate in a decoder) starts from the embedding
v_0 = h_1. Sub-layer l reads an input h_l and writes an output v_l = f_l(h_l). The schemes differ in h_l:

standard PreNorm   h_l = v_0 + v_1 + … + v_{l-1}               (every earlier output weighs 1: grows O(l))
Full AttnRes       h_l = Σ_{i<l} α_{i→l} v_i,  α_{·→l} = softmax_i(w_lᵀ RMSNorm(v_i))
Block AttnRes      the sub-layers form blocks of ``block_size``; each completed block is the sum of its outputs;
                   h_l attends, as above, over [v_0, completed block sums, the current block's partial sum].

w_l is a learned pseudo-query per sub-layer (zero at start: a uniform average), with no 1/√d. One more query
aggregates the sources after the last sub-layer (K3: before the output norm).
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Parameter-free RMSNorm over the last axis: x / sqrt(mean(x²) + eps)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def depth_attention(query: np.ndarray, sources: list[np.ndarray], eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """h = Σ_i softmax_i(queryᵀ RMSNorm(v_i)) v_i, separately for every token.

    query: [D]; sources: N arrays [T, D] -> (h [T, D], weights [T, N]); the softmax runs over the N sources
    (over depth), never over tokens or channels.
    """
    n_tokens = sources[0].shape[0]
    h = np.zeros_like(sources[0])
    weights = np.zeros((n_tokens, len(sources)))
    for t in range(n_tokens):
        logits = np.array([query @ rms_norm(v[t], eps) for v in sources])     # [N]
        weights[t] = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        h[t] = sum(weights[t, i] * v[t] for i, v in enumerate(sources))
    return h, weights


def block_sources(embedding: np.ndarray, outputs: list[np.ndarray], block_size: int) -> list[np.ndarray]:
    """What the next sub-layer attends over: [v_0, completed block sums, current partial sum (if non-empty)].

    ``outputs`` are v_1 … v_{l-1}, each [T, D]; blocks hold ``block_size`` consecutive outputs.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    sources = [embedding]
    for start in range(0, len(outputs), block_size):
        sources.append(sum(outputs[start:start + block_size]))      # the last one may be partial
    return sources


def run_stack(embedding: np.ndarray, sublayers: list, queries: np.ndarray | None = None,
              block_size: int | None = None, eps: float = 1e-6) -> tuple[np.ndarray, list[np.ndarray]]:
    """Run sub-layers f_l (callables [T, D] -> [T, D]) under one residual scheme.

    queries None: standard residual. Otherwise queries [L + 1, D] (one per sub-layer and a final one) and
    block_size None for Full AttnRes, an int for Block AttnRes.
    Returns (final hidden state [T, D], the inputs h_1 … h_L that the sub-layers read).
    """
    outputs, inputs = [], []
    for index, sublayer in enumerate(sublayers):
        h = _read(embedding, outputs, queries, block_size, index, eps)
        inputs.append(h)
        outputs.append(sublayer(h))
    return _read(embedding, outputs, queries, block_size, len(sublayers), eps), inputs


def _read(embedding, outputs, queries, block_size, index, eps) -> np.ndarray:
    if queries is None:
        return embedding + sum(outputs, np.zeros_like(embedding))
    sources = [embedding, *outputs] if block_size is None else block_sources(embedding, outputs, block_size)
    return depth_attention(queries[index], sources, eps)[0]
