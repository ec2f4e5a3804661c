"""Plausible wrong answers for chapter 09's NumPy rung (naive and absorbed attention from the cache)."""

import numpy as np

from k3course.reference import mla as ref


def _attend(q_nope, q_rope, cache, weights, start, visible_rows, scale_dims=None, dtype=np.float64):
    k_up, v_up = weights["k_up"], weights["v_up"]
    rank = k_up.shape[2]
    scale = 1 / np.sqrt(scale_dims or q_nope.shape[-1] + q_rope.shape[-1])
    out = np.zeros((q_nope.shape[0], k_up.shape[0], v_up.shape[1]), dtype=dtype)
    for t in range(q_nope.shape[0]):
        rows = cache[:visible_rows(t)]
        for h in range(k_up.shape[0]):
            scores = (rows[:, :rank] @ k_up[h].T @ q_nope[t, h] + rows[:, rank:] @ q_rope[t, h]) * scale
            out[t, h] = ref.softmax(scores) @ (rows[:, :rank] @ v_up[h].T)
    return out


def no_causal_mask(q_nope, q_rope, cache, weights, start=0):
    """Every query sees the whole cache, later tokens included."""
    return _attend(q_nope, q_rope, cache, weights, start, lambda t: len(cache))


def positions_without_the_cache_offset(q_nope, q_rope, cache, weights, start=0):
    """Query t sees rows ≤ t, forgetting that it sits at position start + t."""
    return _attend(q_nope, q_rope, cache, weights, start, lambda t: t + 1)


def scaled_by_the_nope_dims_only(q_nope, q_rope, cache, weights, start=0):
    """1/sqrt(nope) instead of 1/sqrt(nope + rope)."""
    return _attend(q_nope, q_rope, cache, weights, start, lambda t: start + t + 1, q_nope.shape[-1])


def in_float32(q_nope, q_rope, cache, weights, start=0):
    return _attend(q_nope, q_rope, cache, weights, start, lambda t: start + t + 1, dtype=np.float32)


def absorbed_without_the_value_projection(q_nope, q_rope, cache, weights, start=0):
    """Absorbs W_UK into the query but forgets W_UV: returns the first v entries of the attended latent."""
    rank = weights["k_up"].shape[2]
    out = np.zeros((q_nope.shape[0], weights["k_up"].shape[0], weights["v_up"].shape[1]))
    for t in range(q_nope.shape[0]):
        rows = cache[: start + t + 1]
        for h in range(out.shape[1]):
            scores = (rows[:, :rank] @ (weights["k_up"][h].T @ q_nope[t, h]) + rows[:, rank:] @ q_rope[t, h])
            latent = ref.softmax(scores / np.sqrt(q_nope.shape[-1] + q_rope.shape[-1])) @ rows[:, :rank]
            out[t, h, : min(rank, out.shape[2])] = latent[: out.shape[2]]
    return out


COMMON = [no_causal_mask, positions_without_the_cache_offset, scaled_by_the_nope_dims_only, in_float32]
WRONG = {"09.attend_naive_numpy": COMMON, "09.attend_absorbed_numpy": [*COMMON, absorbed_without_the_value_projection]}
