"""Chapter 09, the NumPy rung: MLA attention from the compressed cache, naive (up-project every row) and
absorbed (attend over the latent rows themselves)."""

from __future__ import annotations

import numpy as np

from k3course.grading.registry import NUMPY_ONLY, Case, Exercise, register
from k3course.reference import mla as ref


def attend_naive_numpy(q_nope, q_rope, cache, weights, start=0):
    """k_s = W_UK[h] c_s, v_s = W_UV[h] c_s for every cached row; causal softmax over s ≤ start + t of
    (q_nope·k_s + q_rope·k_rope_s)/sqrt(nope + rope). q_nope [T, H, nope], q_rope [T, H, rope],
    cache [S, r + rope], weights {"k_up" [H, nope, r], "v_up" [H, v, r]} -> o [T, H, v]."""
    return ref.attend_naive(q_nope, q_rope, cache, weights, start)


def attend_absorbed_numpy(q_nope, q_rope, cache, weights, start=0):
    """The same output with W_UK absorbed into the query and W_UV applied after the softmax."""
    return ref.attend_absorbed(q_nope, q_rope, cache, weights, start)


def mla_case(seed: int, T: int, start: int = 0, H: int = 3, nope: int = 4, rope: int = 2, rank: int = 6,
             v: int = 5) -> tuple:
    """(q_nope, q_rope, cache [start + T, rank + rope], {"k_up", "v_up"}, start), seeded, float64."""
    rng = np.random.default_rng(seed)
    weights = {"k_up": rng.standard_normal((H, nope, rank)) / 2, "v_up": rng.standard_normal((H, v, rank))}
    return (rng.standard_normal((T, H, nope)), rng.standard_normal((T, H, rope)),
            rng.standard_normal((start + T, rank + rope)), weights, start)


def _cases() -> list[Case]:
    return [Case("prefill: T = 5 from an empty cache", mla_case(1, 5)),
            Case("decode: one query after 6 cached tokens", mla_case(2, 1, start=6)),
            Case("3 queries after 4 cached tokens", mla_case(3, 3, start=4)),
            Case("one head, rope 4, rank 3", mla_case(4, 4, start=2, H=1, rope=4, rank=3))]


ATTENTION = (ref.attend_naive, ref.attend_absorbed)  # either one answers both exercises
register(Exercise("09.attend_naive_numpy", attend_naive_numpy, _cases, forbidden=NUMPY_ONLY, package=ATTENTION))
register(Exercise("09.attend_absorbed_numpy", attend_absorbed_numpy, _cases, forbidden=NUMPY_ONLY, package=ATTENTION))
