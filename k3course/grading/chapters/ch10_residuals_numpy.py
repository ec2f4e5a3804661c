"""Chapter 10, the NumPy rung: Full and Block AttnRes over a stack of sub-layers."""

from __future__ import annotations

import numpy as np

from k3course.grading.registry import NUMPY_ONLY, Case, Exercise, register
from k3course.reference import attnres as ref


def attnres_stack_numpy(embedding, sublayers, queries, block_size=None):
    """Run the sub-layers, each reading h_l = Σ_i softmax_i(w_lᵀ RMSNorm(src_i)) src_i over the sources (all
    outputs so far for Full AttnRes, block_size None; the embedding, completed block sums and the current
    partial sum for Block AttnRes), then one final read with the last query. embedding [T, D], sublayers:
    L functions [T, D] -> [T, D], queries [L + 1, D] -> (final [T, D], the inputs h_1 … h_L)."""
    return ref.run_stack(embedding, sublayers, queries, block_size)


def stack_case(seed: int, L: int, T: int = 4, D: int = 6, query_scale: float = 1.0) -> tuple:
    """(embedding [T, D], L tanh sub-layers, queries [L + 1, D]), seeded, float64."""
    rng = np.random.default_rng(seed)
    maps = [rng.standard_normal((D, D)) / np.sqrt(D) for _ in range(L)]
    sublayers = [lambda h, m=m: np.tanh(h @ m) * 2 for m in maps]
    return rng.standard_normal((T, D)), sublayers, query_scale * rng.standard_normal((L + 1, D))


def _cases() -> list[Case]:
    return [Case("Full AttnRes, 5 sub-layers", stack_case(1, 5)),
            Case("Block AttnRes, 6 sub-layers in blocks of 2", stack_case(2, 6), {"block_size": 2}),
            Case("blocks of 4 over 6 sub-layers: a partial last block", stack_case(3, 6), {"block_size": 4}),
            Case("zero queries: every read is a plain average", stack_case(4, 4, query_scale=0.0), {"block_size": 3}),
            Case("block_size 1 is Full AttnRes", stack_case(5, 3), {"block_size": 1})]


register(Exercise("10.attnres_stack_numpy", attnres_stack_numpy, _cases, forbidden=NUMPY_ONLY,
                  package=(ref.run_stack,)))
