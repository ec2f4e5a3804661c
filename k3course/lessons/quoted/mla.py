"""Chapter 09: one MLA layer, its cache and the absorbed form. Each function is a number a lesson quotes (see
:mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

from k3course import accounting
from k3course.config import K3Config
from k3course.lessons.quoted.markers import CONTEXT_1M, quoted
from k3course.lessons.quoted.size import k3_config


@quoted
def mla_layer_params_m(name: str = "kimi-k3") -> float:
    """One gated MLA layer's parameters, in millions."""
    return accounting.mla_layer_params(K3Config.preset(name)) / 1e6


@quoted
def mla_gate_params_m() -> float:
    """K3's MLA output gate (d × H·d_v), in millions of parameters."""
    cfg = k3_config()
    return cfg.d_model * cfg.mla_n_heads * cfg.v_head_dim / 1e6


def _per_token_numbers(scheme: str) -> int:
    cfg = k3_config()
    return {"mha": accounting.mha_cache_numbers(cfg.mla_n_heads, 128),
            "gqa": accounting.gqa_cache_numbers(8, 128, n_heads=cfg.mla_n_heads),
            "mla": accounting.mla_cache_numbers(cfg.kv_lora_rank, cfg.qk_rope_head_dim)}[scheme]


@quoted
def cache_shrink(big: str, small: str) -> float:
    """Per-token cache of ``big`` over ``small`` ("mha", "gqa", "mla"), K3's heads (GQA: 8 key-value heads)."""
    return _per_token_numbers(big) / _per_token_numbers(small)


@quoted
def all_layers_cache_gib(scheme: str, context: int = CONTEXT_1M) -> float:
    """``scheme`` ("mha", "gqa", "mla") in all of K3's layers: one sequence's cache at ``context``, GiB (bf16)."""
    return context * _per_token_numbers(scheme) * 2 * k3_config().n_layers / 2**30


@quoted
def all_layers_cache_tib(scheme: str, context: int = CONTEXT_1M) -> float:
    """The same in TiB."""
    return all_layers_cache_gib(scheme, context) / 2**10


@quoted
def absorbed_ratio(context: int = CONTEXT_1M, size: str = "k3") -> float:
    """Naive over absorbed multiply-adds of one MLA decode step ("k3" sizes, or lesson 09's "mid" layer)."""
    dims = (dict(n_heads=96, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
            if size == "k3" else dict(n_heads=16, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                      v_head_dim=32))
    return (accounting.decode_step_flops(context, absorbed=False, **dims)
            / accounting.decode_step_flops(context, absorbed=True, **dims))


@quoted
def absorbed_slope_ratio(size: str = "k3") -> float:
    """The ratio of the two per-token slopes, (d_nope + d_v)·r / (2r + d_rope)."""
    r, nope, rope, v = (512, 128, 64, 128) if size == "k3" else (128, 32, 16, 32)
    return (nope + v) * r / (2 * r + rope)
