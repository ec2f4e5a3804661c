"""Baselines beside the config presets: the dense Transformer a K3 configuration is measured against, with the
same active parameters (lesson 12's first claim; ``k3course bench step`` and ``bench train`` time it beside K3).

    dense_transformer   all-MLA (ungated, RoPE), SwiGLU, PreNorm, a dense FFN in every layer, its width solved
    solve_width         the integer width whose affine measure (a parameter or FLOP count) is nearest a target
    active_params       a configuration's active parameters (the accounting's count)
"""

from __future__ import annotations

from collections.abc import Callable

from k3course import accounting
from k3course.config import K3Config


def solve_width(make: Callable[[int], K3Config], measure: Callable[[K3Config], int], target: int) -> K3Config:
    """``make(w)`` for the integer w ≥ 1 whose ``measure`` is nearest ``target``; ``measure(make(w))`` must be
    affine in w (a parameter or FLOP count in a width): w = round(1 + (target − m(1)) / (m(2) − m(1)))."""
    at_one, at_two = measure(make(1)), measure(make(2))
    if at_two == at_one:
        raise ValueError("make: the width does not change the measure, so no width can match the target")
    return make(max(1, round(1 + (target - at_one) / (at_two - at_one))))


def active_params(cfg: K3Config) -> int:
    return accounting.param_count(cfg).active


def dense_transformer(cfg: K3Config) -> K3Config:
    """The dense Transformer with ``cfg``'s active parameters, as a practitioner would train it: every layer
    (ungated) MLA with RoPE on its rope dims (DeepSeek-V3's attention: K3's MLA is NoPE because its KDA layers carry
    position, and a model without them would have none), a dense SwiGLU FFN, PreNorm residuals, no MoE; the FFN
    width is solved so its active (= total) parameters equal cfg's active."""
    def make(width: int) -> K3Config:
        return cfg.replace(name=f"dense ({cfg.name})", kda_per_mla=0, mla_gated=False, mla_rope=True,
                           ffn_activation="swiglu", residual="prenorm", first_k_dense=cfg.n_layers,
                           dense_ffn_dim=width)
    return solve_width(make, active_params, active_params(cfg))
