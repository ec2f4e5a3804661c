"""Chapter 00 (tour): count an MoE layer, the routed activation ratio, and the MLA cache per token."""

from __future__ import annotations

import numpy as np

from k3course import accounting
from k3course.accounting import moe_layer_params
from k3course.config import K3Config
from k3course.grading.registry import Case, Exercise, register


def _random_config(rng: np.random.Generator, **changes) -> K3Config:
    """A valid config with seeded random dimensions (small numbers, every feature switchable)."""
    n_layers = int(rng.integers(2, 13))
    n_routed = int(rng.integers(2, 65))
    dims = dict(
        name="random", d_model=int(rng.integers(2, 65)) * 16, n_layers=n_layers,
        first_k_dense=int(rng.integers(0, n_layers)), kda_per_mla=int(rng.integers(0, 5)),
        mla_n_heads=int(rng.integers(1, 9)), kv_lora_rank=int(rng.integers(1, 17)) * 16,
        qk_nope_head_dim=int(rng.integers(1, 5)) * 16, qk_rope_head_dim=int(rng.integers(0, 5)) * 8,
        v_head_dim=int(rng.integers(1, 5)) * 16, n_routed_experts=n_routed, top_k=int(rng.integers(1, n_routed + 1)),
        n_shared_experts=int(rng.integers(0, 3)), expert_dim=int(rng.integers(1, 33)) * 16,
        latent_dim=None if rng.random() < 0.3 else int(rng.integers(1, 33)) * 8)
    dims.update(changes)
    return K3Config(**dims)


def _config_cases() -> list[Case]:
    rng = np.random.default_rng(0)
    cases = [Case(name, (K3Config.preset(name),)) for name in ("kimi-k3", "deepseek-v3", "tiny")]
    cases += [Case(f"random config {i}", (_random_config(rng),)) for i in range(6)]
    cases += [
        Case("no shared experts", (_random_config(rng, n_shared_experts=0),)),
        Case("full-width experts (latent_dim None)", (_random_config(rng, latent_dim=None),)),
        Case("every expert chosen (top_k = n_routed)", (_random_config(rng, n_routed_experts=6, top_k=6),)),
        Case("one expert chosen of one", (_random_config(rng, n_routed_experts=1, top_k=1),)),
        Case("explicit mla_layers", (_random_config(rng, n_layers=12, mla_layers=(1, 2)),)),
    ]
    return cases


def _kv_cases() -> list[Case]:
    rng = np.random.default_rng(1)
    k3 = K3Config.preset("kimi-k3")
    cases = [Case("kimi-k3, bf16", (k3,), {"dtype_bytes": 2}), Case("kimi-k3, fp32", (k3,), {"dtype_bytes": 4}),
             Case("kimi-k2 (all MLA), fp8", (K3Config.preset("kimi-k2"),), {"dtype_bytes": 1}),
             Case("kimi-linear-48b", (K3Config.preset("kimi-linear-48b"),), {"dtype_bytes": 2})]
    cases += [Case(f"random config {i}", (_random_config(rng),), {"dtype_bytes": int(rng.choice([1, 2, 4]))})
              for i in range(6)]
    cases += [Case("all KDA: nothing grows", (K3Config(mla_layers=()),), {"dtype_bytes": 2}),
              Case("no rope dims", (_random_config(rng, qk_rope_head_dim=0),), {"dtype_bytes": 2}),
              Case("explicit mla_layers (not the ratio's plan)",
                   (_random_config(rng, n_layers=12, mla_layers=(0, 1, 5, 6, 7)),), {"dtype_bytes": 2})]
    return cases


def kv_cache_bytes_per_token(cfg: K3Config, dtype_bytes: int = 2) -> int:
    """The package reference: bytes the MLA cache grows by per token (see ``K3Config``)."""
    return accounting.kv_cache_bytes_per_token(cfg, dtype_bytes)


def activation_ratio(cfg: K3Config) -> float:
    """The package reference: routed experts active per token over routed experts."""
    return accounting.activation_ratio(cfg)


register(Exercise("00.moe_layer_params", moe_layer_params, _config_cases))
register(Exercise("00.activation_ratio", activation_ratio, _config_cases, package=(accounting.activation_ratio,)))
register(Exercise("00.kv_cache_bytes_per_token", kv_cache_bytes_per_token, _kv_cases,
                  package=(accounting.kv_cache_bytes_per_token,)))
