"""Chapter 01, the NumPy rung: the top-k MoE forward with shared experts, one token and one expert at a time."""

from __future__ import annotations

import numpy as np
import torch

from k3course.grading.registry import NUMPY_ONLY, Case, Exercise, register
from k3course.moe import MoE
from k3course.reference import moe as ref


def moe_forward_numpy(x, params, top_k):
    """y_t = Σ_{j ∈ TopK(s_t + b)} p_tj E_j(x_t) + shared(x_t); σ scores, SwiGLU experts. x [m, d] -> y [m, d]."""
    return ref.moe_forward(x, params, top_k)


def moe_case(seed: int, m: int, d: int, n: int, k: int, shared: int, bias: float = 0.0, **layer) -> tuple:
    """(x [m, d], params, k) of a torch MoE layer with seeded weights, the bias drawn at scale ``bias``."""
    module = MoE(d, n, k, n_shared_experts=shared, expert_dim=6, generator=torch.Generator().manual_seed(seed),
                 **layer)
    params = module.reference_params()
    rng = np.random.default_rng(seed)
    params["bias"] = bias * rng.standard_normal(n)
    return rng.standard_normal((m, d)), params, k


def _cases() -> list[Case]:
    return [Case("2 shared experts, k=2 of 6, a bias that changes the choice", moe_case(1, 9, 8, 6, 2, 2, 0.5)),
            Case("no shared experts", moe_case(2, 7, 8, 6, 3, 0)),
            Case("k=1", moe_case(3, 5, 8, 6, 1, 1, 0.3)),
            Case("k=n: every expert fires", moe_case(4, 4, 8, 5, 5, 1)),
            Case("one token", moe_case(5, 1, 8, 6, 2, 2, 0.2))]


register(Exercise("01.moe_forward_numpy", moe_forward_numpy, _cases, forbidden=NUMPY_ONLY,
                  package=(ref.moe_forward,)))
