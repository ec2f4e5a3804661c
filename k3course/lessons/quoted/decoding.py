"""Decoding memory and compute (chapters 00, 09, 14), and chapter 14's saved decode benchmark. Each function is a number
a lesson quotes (see :mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

import functools
import json

from k3course import accounting
from k3course.config import K3Config
from k3course.lessons import experiments
from k3course.lessons.quoted.markers import CONTEXT_1M, quoted
from k3course.lessons.quoted.size import k3_config


@quoted
def mla_cache_numbers(name: str = "kimi-k3") -> int:
    """Numbers an MLA layer caches per token: kv_lora_rank + rope."""
    cfg = K3Config.preset(name)
    return accounting.mla_cache_numbers(cfg.kv_lora_rank, cfg.qk_rope_head_dim)


@quoted
def cache_gib(name: str, context: int, schedule: str = "hybrid", dtype_bytes: int = 2) -> float:
    """Decoding memory of one sequence, GiB: the preset as it is ("hybrid") or with every layer MLA."""
    cfg = K3Config.preset(name)
    cfg = cfg.all_mla() if schedule == "all-mla" else cfg
    return accounting.kv_cache_bytes(cfg, context, dtype_bytes) / 2**30


@quoted
def cache_saving(name: str = "kimi-k3", context: int = CONTEXT_1M) -> float:
    """1 − hybrid / all-MLA decoding memory at ``context`` tokens."""
    cfg = K3Config.preset(name)
    return 1 - accounting.kv_cache_bytes(cfg, context) / accounting.kv_cache_bytes(cfg.all_mla(), context)


@quoted
def cache_ratio(name: str = "kimi-k3", context: int = CONTEXT_1M) -> float:
    """All-MLA over hybrid decoding memory at ``context`` tokens."""
    return 1 / (1 - cache_saving(name, context))


@quoted
def saving_ceiling(name: str = "kimi-k3") -> float:
    """The largest saving of the per-token growth: 1 − MLA layers / layers."""
    cfg = K3Config.preset(name)
    return 1 - cfg.n_mla_layers / cfg.n_layers


@quoted
def state_mib(name: str = "kimi-k3", dtype_bytes: int = 2) -> float:
    """The KDA states and conv tails of one sequence (fp32 states), MiB."""
    return accounting.recurrent_state_bytes(K3Config.preset(name), dtype_bytes) / 2**20


@quoted
def crossover(name: str = "kimi-k3", dtype_bytes: int = 2) -> int:
    """The shortest context at which the hybrid holds less decoding memory than all-MLA."""
    return accounting.crossover_context(K3Config.preset(name), dtype_bytes)


@quoted
def decode_flops_ratio(context: int = CONTEXT_1M) -> float:
    """All-MLA over hybrid decode FLOPs per token for K3 at ``context`` tokens."""
    cfg = k3_config()
    return accounting.decode_flops_per_token(cfg.all_mla(), context) / accounting.decode_flops_per_token(cfg, context)


H200 = (4.8e12, 989e12)  # HBM bytes/s, dense bf16 FLOP/s: the roofline lessons 08 and 14 assume
H200_MEMORY = 141e9  # bytes of HBM on one H200 (assumed, lesson 14)


@quoted
def roofline_tpot_ratio(batch: int, context: int = CONTEXT_1M, name: str = "kimi-k3") -> float:
    """All-MLA over hybrid roofline TPOT on an H200 at ``context`` tokens and ``batch`` sequences."""
    cfg = K3Config.preset(name)
    return (accounting.predicted_tpot_s(cfg.all_mla(), context, batch, *H200)
            / accounting.predicted_tpot_s(cfg, context, batch, *H200))


def _schedule(name: str, schedule: str) -> K3Config:
    cfg = K3Config.preset(name)
    return cfg.all_mla() if schedule == "all-mla" else cfg


@quoted
def max_batch(name: str, schedule: str = "hybrid", context: int = CONTEXT_1M) -> int:
    """Sequences of ``context`` tokens one H200's memory holds beside the weights (bf16)."""
    return accounting.max_decode_batch(_schedule(name, schedule), context, H200_MEMORY)


@quoted
def capacity_throughput_ratio(name: str = "kimi-linear-48b", context: int = CONTEXT_1M) -> float:
    """Hybrid over all-MLA roofline throughput (tokens/s) on one H200, each at the largest batch its memory holds."""
    def throughput(cfg: K3Config) -> float:
        batch = accounting.max_decode_batch(cfg, context, H200_MEMORY)
        return batch / accounting.predicted_tpot_s(cfg, context, batch, *H200)
    cfg = K3Config.preset(name)
    return throughput(cfg) / throughput(cfg.all_mla())


@quoted
def tpot_ms(name: str, context: int, batch: int, schedule: str = "hybrid") -> float:
    """Roofline TPOT on one H200, ms."""
    return accounting.predicted_tpot_s(_schedule(name, schedule), context, batch, *H200) * 1e3


@quoted
def weights_gib(name: str = "kimi-linear-48b", dtype_bytes: int = 2) -> float:
    """The whole model's weights, GiB."""
    return accounting.param_count(K3Config.preset(name)).total * dtype_bytes / 2**30


@quoted
def prefill_ratio(name: str = "kimi-linear-48b", context: int = CONTEXT_1M) -> float:
    """All-MLA over hybrid prefill FLOPs for one sequence of ``context`` tokens."""
    cfg = K3Config.preset(name)
    return accounting.prefill_flops(cfg.all_mla(), context) / accounting.prefill_flops(cfg, context)


@quoted
def experts_touched(name: str, batch: int) -> float:
    """Routed experts of one MoE layer that a decode step of ``batch`` tokens runs, on average (uniform routing)."""
    cfg = K3Config.preset(name)
    return accounting.experts_touched(cfg.n_routed_experts, cfg.top_k, batch)


@quoted
def h200_balance() -> float:
    """FLOPs per byte at which an H200 turns from memory-bound to compute-bound."""
    return H200[1] / H200[0]


@quoted
def kda_step_flops_per_byte() -> float:
    """FLOPs per byte one K3 KDA layer's decode step does (7·H·K·V over its state and conv tails)."""
    cfg = k3_config()
    nbytes = accounting.kda_step_bytes(cfg.kda_n_heads, cfg.kda_head_dim, cfg.kda_head_dim, cfg.kda_conv_size, 2)
    return 7 * cfg.kda_n_heads * cfg.kda_head_dim ** 2 / nbytes


@quoted
def mla_step_flops_per_byte() -> float:
    """FLOPs per byte of K3's absorbed MLA decode step (any context: both are linear in it)."""
    cfg = k3_config()
    flops = 2 * cfg.mla_n_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return flops / accounting.mla_step_bytes(1, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 2)


@quoted
def mla_over_kda_step_bytes(context: int = CONTEXT_1M) -> float:
    """Bytes one K3 MLA layer's decode step reads at ``context`` over one KDA layer's (bf16 cache, fp32 state)."""
    cfg = k3_config()
    kda = accounting.kda_step_bytes(cfg.kda_n_heads, cfg.kda_head_dim, cfg.kda_head_dim, cfg.kda_conv_size, 2)
    return accounting.mla_step_bytes(context, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 2) / kda


@quoted
def a2a_bytes_per_token(name: str = "kimi-k3") -> int:
    """The bytes one token sends and gets back per MoE layer in bf16: 2 · top_k · width · 2 (width ℓ, or d)."""
    cfg = K3Config.preset(name)
    return 2 * cfg.top_k * (cfg.latent_dim or cfg.d_model) * 2

@functools.cache
def _decode_bench() -> dict:
    return json.loads((experiments.RESULTS / "decode_bench.json").read_text())


@quoted
def decode_slope_ratio(schedule: str = "hybrid 3:1", batch: int = 1, statistic: str = "median") -> float:
    """The saved decode benchmark's TPOT slope of ``schedule`` over all-MLA's."""
    return _decode_bench()["slopes"][str(batch)][statistic]["over_all_mla"][schedule]


KIMI_LINEAR_TPOT_SPEEDUP = 6.3  # Kimi Linear's published TPOT speed-up over full attention at 1M tokens (†)


@quoted
def published_tpot_gap(against: str = "tpot") -> float:
    """The published 6.3× over the roofline's ratio on Kimi Linear 48B at 1M tokens: ``against`` "tpot" (equal
    batch) or "throughput" (each schedule at the batch its memory holds)."""
    ratio = roofline_tpot_ratio(1, CONTEXT_1M, "kimi-linear-48b") if against == "tpot" else capacity_throughput_ratio()
    return KIMI_LINEAR_TPOT_SPEEDUP / ratio


@quoted
def shipped_step_read_mib(dtype_bytes: int = 4) -> float:
    """MiB of weights one decode step of the shipped tiny K3 reads at batch 1 (its top-2 of 8 experts per MoE layer,
    one embedding row; :func:`k3course.accounting.decode_weight_params`), float32 by default as lesson 16 runs it."""
    from k3course.lessons import capstone

    return accounting.decode_weight_params(capstone.shipped_config()["model"], 1) * dtype_bytes / 2 ** 20
