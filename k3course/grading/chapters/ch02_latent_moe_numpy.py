"""Chapter 02, the NumPy rung: the Stable LatentMoE forward with SiTU-GLU experts, token by token."""

from __future__ import annotations

import numpy as np
import torch

from k3course.grading.registry import NUMPY_ONLY, Case, Exercise, register
from k3course.moe import LatentMoE
from k3course.reference import moe as ref


def latent_moe_forward_numpy(x, params, top_k):
    """y_t = shared(x_t) + RMSNorm(Σ_j p_tj E_j(x_t W↓)) W↑ with SiTU-GLU experts and shared experts.
    x [m, d] -> y [m, d]."""
    return ref.moe_forward(x, params, top_k, activation="situ_glu")


def latent_moe_case(seed: int, m: int, k: int, shared: int, scale: float = 1.0, bias: float = 0.0) -> tuple:
    """(x [m, 8], params, k) of a torch LatentMoE (d 8, latent 4, 6 experts) with seeded weights; x at ``scale``."""
    module = LatentMoE(8, 6, k, n_shared_experts=shared, expert_dim=5, activation="situ_glu",
                       generator=torch.Generator().manual_seed(seed))
    params = module.reference_params()
    rng = np.random.default_rng(seed)
    params["bias"] = bias * rng.standard_normal(6)
    params["latent_norm"] = 1 + 0.3 * rng.standard_normal(4)
    return scale * rng.standard_normal((m, 8)), params, k


def _cases() -> list[Case]:
    return [Case("2 shared experts, k=2, a bias", latent_moe_case(1, 9, 2, 2, bias=0.5)),
            Case("no shared experts, k=3", latent_moe_case(2, 6, 3, 0)),
            Case("k=1: the norm makes one expert's output unit-RMS", latent_moe_case(3, 5, 1, 1)),
            Case("large inputs: SiTU-GLU's caps bite", latent_moe_case(4, 5, 2, 1, scale=40.0))]


register(Exercise("02.latent_moe_forward_numpy", latent_moe_forward_numpy, _cases, forbidden=NUMPY_ONLY,
                  package=(ref.moe_forward,)))
