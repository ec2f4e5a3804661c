"""Accounting: what a K3-style model costs, from its dimensions alone (lessons 00, 09, 11 and 14).

- parameters, total and active per token, and where they live (:func:`param_count`), counted a second,
  independent way from the real modules built on the meta device (:func:`meta_param_count`);
- decoding memory per sequence: the MLA latent cache grows with every token, the KDA state is a constant
  (:func:`kv_cache_bytes_per_token`, :func:`recurrent_state_bytes`, :func:`kv_cache_bytes`), and the numbers
  per token of MHA, GQA, MLA and KDA (:func:`mha_cache_numbers` ...);
- the fraction of routed experts a token uses (:func:`activation_ratio`);
- FLOPs and bytes of one decode step (:func:`decode_flops_per_token`, :func:`decode_step_flops`,
  :func:`kda_step_bytes`, :func:`mla_step_bytes`, :func:`decode_step_bytes` with the experts a batch touches,
  :func:`experts_touched`), the hybrid's memory crossover, a roofline TPOT, the largest batch a GPU's memory
  holds (:func:`max_decode_batch`) and the FLOPs of a prefill (:func:`prefill_flops`).

It sits above the model: the formulas read a :class:`~k3course.config.K3Config`, the meta counts build
the layers and :class:`~k3course.model.K3Model`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from k3course.config import K3Config
from k3course.guards import is_number
from k3course.layers.kda import KimiDeltaAttention
from k3course.layers.mla import GatedMLA
from k3course.model import K3Model
from k3course.moe.experts import GLUFFN
from k3course.moe.layers import MoE


def _require_config(cfg) -> None:
    if not isinstance(cfg, K3Config):
        raise TypeError(f"cfg must be a K3Config (e.g. K3Config.preset('tiny')), got {type(cfg).__name__}")


def _check_dtype_bytes(dtype_bytes: int) -> None:
    if not is_number(dtype_bytes) or dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be a positive int (2 for bf16, 4 for fp32), got {dtype_bytes!r}")


# --- the whole model, from its dimensions ---------------------------------------------------------------

def param_count(cfg: K3Config) -> ParamCount:
    """Total and active (per token) parameters, with a per-component breakdown.

    Active = everything a token touches: all weights except the routed experts it was not sent to
    (``top_k`` of ``n_routed_experts`` per MoE layer). Balancing biases are buffers, not parameters.
    """
    _require_config(cfg)
    return ParamCount.from_components(_component_counts(cfg))


def activation_ratio(cfg: K3Config) -> float:
    """Routed experts active per token over routed experts: ``top_k / n_routed_experts``."""
    return cfg.top_k / cfg.n_routed_experts


def kv_cache_bytes_per_token(cfg: K3Config, dtype_bytes: int = 2) -> int:
    """Bytes the decoding cache GROWS by per token: MLA layers only.

    Each MLA layer caches its compressed latent c_KV and the shared rope key per token:
    ``n_mla_layers · (kv_lora_rank + qk_rope_head_dim) · dtype_bytes`` (K3: 24 · 576 · 2 B).
    KDA layers add nothing per token: their state is constant (``recurrent_state_bytes``).
    """
    _check_dtype_bytes(dtype_bytes)
    return cfg.n_mla_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes


def recurrent_state_bytes(cfg: K3Config, dtype_bytes: int = 2, state_bytes: int = 4) -> int:
    """Bytes of the KDA state, CONSTANT in the context length.

    Per KDA layer: the state S ∈ R^{H×K×V}, kept in fp32 (``state_bytes`` = 4) whatever the activations'
    dtype, plus the short-conv tails, the last ``conv_size − 1`` inputs of the q, k and v convolutions in the
    activations' dtype: ``H·K·V·state_bytes + (conv_size − 1)·(2·H·K + H·V)·dtype_bytes``.
    """
    _check_dtype_bytes(dtype_bytes)
    _check_dtype_bytes(state_bytes)
    heads, width = cfg.kda_n_heads, cfg.kda_head_dim
    state = heads * width * width * state_bytes
    conv_tails = (cfg.kda_conv_size - 1) * 3 * heads * width * dtype_bytes
    return cfg.n_kda_layers * (state + conv_tails)


def kv_cache_bytes(cfg: K3Config, context: int, dtype_bytes: int = 2) -> int:
    """Decoding memory for one sequence of ``context`` tokens:
    ``context · kv_cache_bytes_per_token + recurrent_state_bytes`` (growing part + constant part)."""
    if not is_number(context) or context < 0:
        raise ValueError(f"context must be a token count (int ≥ 0), got {context!r}")
    return context * kv_cache_bytes_per_token(cfg, dtype_bytes) + recurrent_state_bytes(cfg, dtype_bytes)


def decode_flops_per_token(cfg: K3Config, context: int) -> int:
    """Approximate FLOPs to decode one token with ``context`` tokens already cached.

    weights   2 · (active parameters − the embedding table)    (a multiply-add per weight; lookup is free; a tied
              LM head multiplies by the table, so then it stays)
    MLA       2 · H · (2·kv_lora_rank + rope) · context per MLA layer: absorbed decoding scores each cached
              576-wide entry (kv_lora + rope) and mixes the kv_lora-wide latents
    KDA       7 · H · K · V per KDA layer: decay, Sᵀk, the rank-1 delta update, Sᵀq; constant in context
    """
    if not is_number(context) or context < 0:
        raise ValueError(f"context must be a token count (int ≥ 0), got {context!r}")
    weights = 2 * _multiplied_params(cfg)
    mla = cfg.n_mla_layers * 2 * cfg.mla_n_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * context
    kda = cfg.n_kda_layers * 7 * cfg.kda_n_heads * cfg.kda_head_dim ** 2
    return weights + mla + kda


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model: ``total``, ``active`` per token, and ``components`` {name: (total, active)}."""

    total: int
    active: int
    components: dict[str, tuple[int, int]]

    @classmethod
    def from_components(cls, components: dict[str, tuple[int, int]]) -> ParamCount:
        total = sum(t for t, _ in components.values())
        active = sum(a for _, a in components.values())
        return cls(total, active, components)


def _multiplied_params(cfg: K3Config) -> int:
    """Active parameters a token multiplies by: all but the embedding table (a lookup), unless the head is tied
    to it (then the head's product uses the table)."""
    count = param_count(cfg)
    return count.active - (0 if cfg.tie_embeddings else count.components["embedding"][1])


# --- the analytic count, component by component --------------------------------------------------------

def _linear(d_in: int, d_out: int) -> int:
    """A bias-free linear map R^d_in → R^d_out."""
    return d_in * d_out


def _gated_mlp(d_in: int, width: int) -> int:
    """SwiGLU / SiTU-GLU MLP: gate and up (d_in → width), down (width → d_in)."""
    return 3 * d_in * width


def kda_layer_params(cfg: K3Config) -> int:
    """One KDA token mixer (lesson 06), H = kda_n_heads, K = V = kda_head_dim, d = d_model.

    q, k, v projections 3·d·HK; depthwise short convs 3·HK·conv_size; β projection d·H;
    forget gate low-rank d·K + K·HK with A_log (H) and dt_bias (HK); output gate d·HK (full) or
    d·K + K·HK (low rank) + HK for its bias (kda_gate_bias: fla's layer, not Kimi Linear's checkpoints);
    per-head output RMSNorm K; output projection HK·d.
    """
    _require_config(cfg)
    d, heads, width = cfg.d_model, cfg.kda_n_heads, cfg.kda_head_dim
    inner = heads * width
    projections = 3 * _linear(d, inner)
    convs = 3 * inner * cfg.kda_conv_size
    beta = _linear(d, heads)
    forget_gate = _linear(d, width) + _linear(width, inner) + heads + inner
    if cfg.kda_output_gate == "full":
        output_gate = _linear(d, inner)
    else:
        output_gate = _linear(d, width) + _linear(width, inner) + (inner if cfg.kda_gate_bias else 0)
    return projections + convs + beta + forget_gate + output_gate + width + _linear(inner, d)


def mla_layer_params(cfg: K3Config) -> int:
    """One (gated) MLA token mixer (lesson 09), H = mla_n_heads.

    Query: d → q_lora_rank (+ RMSNorm) → H·(nope + rope), or d → H·(nope + rope) when q_lora_rank is None.
    Keys / values: d → kv_lora_rank + rope (+ RMSNorm on the latent); latent → H·(nope + v).
    Output gate (gated MLA) d → H·v; output projection H·v → d.
    """
    _require_config(cfg)
    d, heads = cfg.d_model, cfg.mla_n_heads
    qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
        query = _linear(d, heads * qk_dim)
    else:
        query = _linear(d, cfg.q_lora_rank) + cfg.q_lora_rank + _linear(cfg.q_lora_rank, heads * qk_dim)
    latent = _linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    up = _linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    gate = _linear(d, heads * cfg.v_head_dim) if cfg.mla_gated else 0
    return query + latent + up + gate + _linear(heads * cfg.v_head_dim, d)


def moe_layer_params(cfg: K3Config) -> tuple[int, int]:
    """(total, active) parameters of one MoE layer.

    routed experts  n · 3·e·f   with e = latent_dim (or d_model), f = expert_dim; active: top_k of them
    shared experts  3·d·(n_shared·f)            (always on)
    latent          d·ℓ + ℓ·d + ℓ (down, up, RMSNorm on the latent output; 0 without latent)
    router          n·d                          (the balancing bias is a buffer, not counted)
    """
    _require_config(cfg)
    routed_total, routed_active = _routed_expert_params(cfg)
    always_on = _shared_expert_params(cfg) + _latent_projection_params(cfg) + _router_params(cfg)
    return routed_total + always_on, routed_active + always_on


def _expert_input_dim(cfg: K3Config) -> int:
    return cfg.d_model if cfg.latent_dim is None else cfg.latent_dim


def _routed_expert_params(cfg: K3Config) -> tuple[int, int]:
    one = _gated_mlp(_expert_input_dim(cfg), cfg.expert_dim)
    return cfg.n_routed_experts * one, cfg.top_k * one


def _shared_expert_params(cfg: K3Config) -> int:
    return _gated_mlp(cfg.d_model, cfg.n_shared_experts * cfg.expert_dim)


def _latent_projection_params(cfg: K3Config) -> int:
    if cfg.latent_dim is None:
        return 0
    return 2 * _linear(cfg.d_model, cfg.latent_dim) + cfg.latent_dim


def _router_params(cfg: K3Config) -> int:
    return _linear(cfg.d_model, cfg.n_routed_experts)


def _norm_and_residual_params(cfg: K3Config) -> int:
    """RMSNorm before each sub-layer (2 per layer) and the final norm; Block AttnRes adds a query per
    sub-layer (2 per layer) and one for the final aggregation, each of width d, and as many key-norm weights
    with ``attnres_key_weight``."""
    d = cfg.d_model
    norms = 2 * cfg.n_layers * d + d
    per_read = 1 + cfg.attnres_key_weight if cfg.residual == "block_attnres" else 0
    return norms + per_read * (2 * cfg.n_layers + 1) * d


def _component_counts(cfg: K3Config) -> dict[str, tuple[int, int]]:
    """{component: (total, active)} summed over the whole model."""
    moe = cfg.n_moe_layers
    routed_total, routed_active = _routed_expert_params(cfg)
    embedding = _linear(cfg.vocab_size, cfg.d_model)
    parts = {
        "embedding": embedding,
        "lm_head": 0 if cfg.tie_embeddings else embedding,
        "kda_attention": cfg.n_kda_layers * kda_layer_params(cfg),
        "mla_attention": cfg.n_mla_layers * mla_layer_params(cfg),
        "dense_ffn": cfg.first_k_dense * _gated_mlp(cfg.d_model, cfg.dense_ffn_dim),
        "shared_experts": moe * _shared_expert_params(cfg),
        "latent_projections": moe * _latent_projection_params(cfg),
        "router": moe * _router_params(cfg),
        "norms_and_residual": _norm_and_residual_params(cfg),
    }
    components = {name: (count, count) for name, count in parts.items()}
    components["routed_experts"] = (moe * routed_total, moe * routed_active)
    return components


# --- the same count from the real modules, built on the meta device ------------------------------------------

def meta_layer(cfg: K3Config, kind: str) -> nn.Module:
    """The package's real layer of ``kind`` ("kda", "mla", "dense_ffn", "moe") for ``cfg``, on the meta device."""
    _require_config(cfg)
    builders = {"kda": KimiDeltaAttention.from_config, "mla": GatedMLA.from_config, "moe": MoE.from_config,
                "dense_ffn": lambda c: GLUFFN(c.d_model, c.dense_ffn_dim, c.ffn_activation)}
    if kind not in builders:
        raise ValueError(f"kind: unknown layer kind {kind!r}; choose one of {', '.join(builders)}")
    with torch.device("meta"):
        return builders[kind](cfg)


def meta_param_count(cfg: K3Config) -> dict[str, tuple[int, int]]:
    """{component: (total, active)} counted from :class:`k3course.model.K3Model` built on the meta device
    (shapes, no memory: the full K3 in seconds), plus "total" and "active" as ints. Equal to
    :func:`param_count` by construction — a test holds them together for every preset."""
    _require_config(cfg)
    parts = K3Model.from_config(cfg, device="meta").param_breakdown()
    return {**parts, "total": sum(t for t, _ in parts.values()), "active": sum(a for _, a in parts.values())}


# --- decoding: cache numbers, bytes and FLOPs per step ----------------------------------------------------

def mha_cache_numbers(n_heads: int, head_dim: int) -> int:
    """Multi-head attention caches a key and a value per head: 2·H·d_h numbers per token."""
    return 2 * n_heads * head_dim


def gqa_cache_numbers(n_kv_heads: int, head_dim: int, n_heads: int | None = None) -> int:
    """Grouped-query attention caches 2·G·d_h per token (G key/value heads shared by groups of query heads)."""
    if n_heads is not None and n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    return 2 * n_kv_heads * head_dim


def mla_cache_numbers(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """MLA caches the normalised latent and the shared rope key: kv_lora_rank + rope per token."""
    return kv_lora_rank + qk_rope_head_dim


def kda_state_numbers(n_heads: int, head_k_dim: int, head_v_dim: int, conv_size: int = 4) -> int:
    """A KDA layer keeps a fixed state, whatever the context: H·K·V for S plus the short-conv tails of q, k, v.

    The conv tails hold (conv_size − 1) past inputs for each of the q, k and v channels.
    """
    return n_heads * head_k_dim * head_v_dim + (conv_size - 1) * n_heads * (2 * head_k_dim + head_v_dim)


def decode_step_flops(context: int, n_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                      qk_rope_head_dim: int, v_head_dim: int, absorbed: bool) -> int:
    """Multiply-adds of attending one new token over ``context`` cached tokens (projections of x excluded).

    naive:    up-project the cache (S·H·r·(nope + v)) + scores (S·H·(nope + rope)) + weighted values (S·H·v)
    absorbed: absorb the query (H·nope·r) + scores (S·H·(r + rope)) + weighted latents (S·H·r) + W_UV (H·r·v)
    """
    s, h, r = context, n_heads, kv_lora_rank
    if absorbed:
        return h * qk_nope_head_dim * r + s * h * (r + qk_rope_head_dim) + s * h * r + h * r * v_head_dim
    up_projection = s * h * r * (qk_nope_head_dim + v_head_dim)
    return up_projection + s * h * (qk_nope_head_dim + qk_rope_head_dim) + s * h * v_head_dim


def kda_step_bytes(n_heads: int, head_k_dim: int, head_v_dim: int, conv_size: int, dtype_bytes: int,
                   state_bytes: int = 4) -> int:
    """Bytes one KDA layer reads per decode step, per sequence: its whole cache, constant in the context.

    state S [H, K, V] in fp32 + conv tails [(conv_size − 1), 2·H·K + H·V] in the activation dtype:
    ``H·K·V·state_bytes + (conv_size − 1)·(2·H·K + H·V)·dtype_bytes``.
    """
    state = n_heads * head_k_dim * head_v_dim * state_bytes
    return state + (conv_size - 1) * n_heads * (2 * head_k_dim + head_v_dim) * dtype_bytes


def mla_step_bytes(context: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: int) -> int:
    """Bytes one MLA layer reads per decode step, per sequence: every cached latent and rope key,
    ``context · (kv_lora_rank + qk_rope_head_dim) · dtype_bytes`` (shared by all heads), linear in the context."""
    return context * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes


def crossover_context(cfg: K3Config, dtype_bytes: int = 2) -> int:
    """The smallest context L at which the hybrid's decoding memory is below all-MLA's.

    hybrid(L) = L·a_h + s_h (per-token growth + the constant KDA state), all-MLA(L) = L·a_m; hybrid < all-MLA
    once L > s_h / (a_m − a_h), so L* = ⌊s_h / (a_m − a_h)⌋ + 1.
    """
    growth_gap = kv_cache_bytes_per_token(cfg.all_mla(), dtype_bytes) - kv_cache_bytes_per_token(cfg, dtype_bytes)
    if growth_gap <= 0:
        raise ValueError(f"cfg: {cfg.name!r} has as many MLA layers as all-MLA, so its memory never drops below")
    return recurrent_state_bytes(cfg, dtype_bytes) // growth_gap + 1


def experts_touched(n_experts: int, top_k: int, batch: int) -> float:
    """Distinct routed experts one MoE layer runs for ``batch`` tokens, on average, with uniform routing
    (each token picks ``top_k`` distinct experts of ``n_experts``, independently of the others):

    E[touched] = n · (1 − (1 − k/n)^B)        (a given expert is missed by one token with probability 1 − k/n)

    k at B = 1, rising toward n: K3's 896 experts with k = 16 are about half touched at B = 43.
    """
    for name, value in (("n_experts", n_experts), ("top_k", top_k), ("batch", batch)):
        if not is_number(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if top_k > n_experts:
        raise ValueError(f"top_k must be at most n_experts = {n_experts}, got {top_k}")
    return n_experts * (1 - (1 - top_k / n_experts) ** batch)


def decode_weight_params(cfg: K3Config, batch: int) -> float:
    """Weights one decode step of ``batch`` sequences reads, in parameters (each read once, shared by the batch):

    active parameters − one token's routed experts + the experts the batch touches (:func:`experts_touched`,
    per MoE layer) − the embedding table + the rows the batch looks up (min(B, vocab) · d)

    The one convention of the course for the embedding: a lookup reads only its token's row; a tied LM head
    (``tie_embeddings``) still reads the whole table, so then nothing is taken off.
    """
    if not is_number(batch) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    count = param_count(cfg)
    table = count.components["embedding"][1]
    rows_not_read = 0 if cfg.tie_embeddings else table - min(batch, cfg.vocab_size) * cfg.d_model
    return count.active - count.components["routed_experts"][1] + _touched_expert_params(cfg, batch) - rows_not_read


def _touched_expert_params(cfg: K3Config, batch: int) -> float:
    """Routed-expert parameters one decode step of ``batch`` sequences runs: per MoE layer, the experts the batch
    touches (:func:`experts_touched`) × one expert's parameters."""
    if not cfg.n_moe_layers:
        return 0.0
    routed_total = param_count(cfg).components["routed_experts"][0]
    per_expert = routed_total / (cfg.n_routed_experts * cfg.n_moe_layers)  # one expert of one layer
    return cfg.n_moe_layers * experts_touched(cfg.n_routed_experts, cfg.top_k, batch) * per_expert


def decode_step_bytes(cfg: K3Config, context: int, batch: int, dtype_bytes: int = 2,
                      weight_bytes: float | None = None) -> float:
    """Bytes one decode step of ``batch`` sequences at ``context`` tokens reads from memory:

    weights   :func:`decode_weight_params` · weight_bytes    (bytes per weight; default ``dtype_bytes``)
    caches    batch · kv_cache_bytes(cfg, context, dtype_bytes)   (each sequence reads its own)
    """
    per_weight = dtype_bytes if weight_bytes is None else weight_bytes
    return decode_weight_params(cfg, batch) * per_weight + batch * kv_cache_bytes(cfg, context, dtype_bytes)


def predicted_tpot_s(cfg: K3Config, context: int, batch: int, bandwidth: float, flops_per_s: float,
                     dtype_bytes: int = 2) -> float:
    """A roofline TPOT: the time of one decode step of ``batch`` sequences at ``context`` tokens each,

    max(bytes / bandwidth, FLOPs / flops_per_s),   bytes = :func:`decode_step_bytes`,
                                                   FLOPs = batch · :func:`decode_flops_per_token`

    (the step streams its bytes and does its FLOPs at once; the slower of the two sets its time).
    """
    if not is_number(batch) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    moved = decode_step_bytes(cfg, context, batch, dtype_bytes)
    return max(moved / bandwidth, batch * decode_flops_per_token(cfg, context) / flops_per_s)


def max_decode_batch(cfg: K3Config, context: int, memory_bytes: float, dtype_bytes: int = 2) -> int:
    """The most sequences of ``context`` tokens that fit in ``memory_bytes`` beside the whole model's weights:
    ⌊(memory − total parameters · dtype_bytes) / kv_cache_bytes(context)⌋, 0 when the weights alone do not fit
    (activations and the allocator's slack are left out: an upper bound)."""
    free = memory_bytes - param_count(cfg).total * dtype_bytes
    return max(0, int(free // kv_cache_bytes(cfg, context, dtype_bytes)))


KDA_CHUNK = 64  # the chunk length of the chunked KDA prefill at scale


def prefill_flops(cfg: K3Config, context: int) -> int:
    """Approximate FLOPs to prefill one sequence of ``context`` tokens (L):

    weights   2 · (active parameters − the embedding table) · L
    MLA       2 · H · (nope + rope + v) · L(L + 1)/2 per MLA layer: causal attention over the up-projected keys and
              values, quadratic in L
    KDA       H · (6·L·d² + 3·L·C·d + L·C²) per KDA layer, the chunked algorithm with chunks of C = KDA_CHUNK
              (head dim d): linear in L
    """
    if not is_number(context) or context < 0:
        raise ValueError(f"context must be a token count (int ≥ 0), got {context!r}")
    weights = 2 * _multiplied_params(cfg) * context
    head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    mla = cfg.n_mla_layers * 2 * cfg.mla_n_heads * head * context * (context + 1) // 2
    d, chunk = cfg.kda_head_dim, KDA_CHUNK
    kda = cfg.n_kda_layers * cfg.kda_n_heads * (6 * context * d * d + 3 * context * chunk * d + context * chunk ** 2)
    return weights + mla + kda


# --- what a token costs: GPUs, weight precision, where the weights sit, a price per GPU-hour -----------------

@dataclass(frozen=True)
class GPU:
    """One accelerator as sold: HBM ``memory`` (bytes), HBM ``bandwidth`` (bytes/s) and dense tensor-core FLOP/s
    by the precision the products run in (``flops["bf16"]``, ``flops["fp8"]``), without sparsity."""

    name: str
    memory: float
    bandwidth: float
    flops: dict[str, float]


GIB = 2 ** 30
# Vendor datasheet figures per GPU (SXM parts; dense, no sparsity): the course's reading of them, marked † where a
# lesson quotes them. Memory: a datasheet's "GB" of HBM are binary (GiB) — an "80 GB" H100 reports 81,559 MiB
# (85.5·10⁹ bytes) in nvidia-smi — so memory is the figure × 2³⁰ bytes; bandwidth and FLOP/s are decimal
# (TB/s = 10¹² bytes/s). B200: 7.7 TB/s as NVIDIA's HGX B200 table gives it (8 TB/s is the GB200 figure); B300
# adds FP4 throughput and memory over B200, 8 TB/s per GPU in NVIDIA's HGX B300 figures; its 8- and 16-bit rates
# are B200's.
GPUS: dict[str, GPU] = {
    "H100": GPU("H100", 80 * GIB, 3.35e12, {"bf16": 989e12, "fp8": 1979e12}),
    "H200": GPU("H200", 141 * GIB, 4.8e12, {"bf16": 989e12, "fp8": 1979e12}),
    "B200": GPU("B200", 180 * GIB, 7.7e12, {"bf16": 2.25e15, "fp8": 4.5e15}),
    "B300": GPU("B300", 288 * GIB, 8e12, {"bf16": 2.25e15, "fp8": 4.5e15}),
}


@dataclass(frozen=True)
class Precision:
    """How a deployment stores its weights: bytes per routed-expert weight and per other weight (scales included),
    and the precision its products run in."""

    routed_bytes: float
    other_bytes: float
    products: str


# weight precision -> Precision. FP8: e4m3 with one fp32 scale per 128 × 128 block (DeepSeek-V3, Kimi K2), every
# weight. INT4: weight-only, one bf16 scale per 32 weights on every weight, the activations and products in bf16
# (compressed-tensors W4A16). MXFP4, as K3 is released: routed experts in e2m1 with one 8-bit power-of-two scale per
# 32 weights (4 + 8/32 = 4.25 bits), attention, shared experts and every other weight in bf16; products in bf16.
WEIGHT_PRECISIONS: dict[str, Precision] = {
    "bf16": Precision(2.0, 2.0, "bf16"),
    "fp8": Precision(1 + 4 / 128 ** 2, 1 + 4 / 128 ** 2, "fp8"),
    "int4": Precision(0.5 + 2 / 32, 0.5 + 2 / 32, "bf16"),
    "mxfp4": Precision(4.25 / 8, 2.0, "bf16"),
}
RELEASED_PRECISION = "mxfp4"  # K3's released checkpoint
# Where the weights sit on the N GPUs of a deployment, and so which weights every GPU reads at each decode step:
# sharded        every weight on exactly one GPU (an ideal: no deployment splits a router that way)
# expert-parallel  lesson 13's layout: the routed experts split over the GPUs; the router, the shared experts and
#                the latent projections replicated on every GPU, which reads them every step; the attention, dense
#                layers, norms, embedding and head split over the GPUs (tensor parallel)
# dp-attention   expert-parallel with data-parallel attention: the attention, dense layers, norms and head
#                replicated too, each GPU running them for its B/N sequences
PLACEMENTS = ("sharded", "expert-parallel", "dp-attention")
MOE_REPLICATED = ("router", "shared_experts", "latent_projections")  # param_count components on every GPU under EP
# The caches: the MLA latents and the short-conv tails in bf16, the KDA state S in fp32
# (:func:`recurrent_state_bytes`), whatever the weights' precision.
CACHE_BYTES = 2
MEMORY_USABLE = 0.9  # of HBM, for weights and caches (the rest: activations, the allocator, the runtime)


def _gpu_and_precision(gpu: GPU | str, precision: str) -> tuple[GPU, Precision]:
    """(the GPU, the precision); errors name the argument."""
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise ValueError(f"gpu: unknown GPU {gpu!r}; choose one of {', '.join(GPUS)} or pass a GPU(...)")
        gpu = GPUS[gpu]
    if not isinstance(gpu, GPU):
        raise ValueError(f"gpu: must be a GPU name ({', '.join(GPUS)}) or a GPU(...), got {gpu!r}")
    if precision not in WEIGHT_PRECISIONS:
        raise ValueError(f"precision: must be one of {', '.join(WEIGHT_PRECISIONS)}, got {precision!r}")
    return gpu, WEIGHT_PRECISIONS[precision]


def weight_bytes(cfg: K3Config, precision: str = "bf16") -> float:
    """Bytes of all the weights at ``precision`` (scales included): routed experts · their bytes per weight +
    every other parameter · its bytes per weight."""
    _, stored = _gpu_and_precision("H100", precision)
    count = param_count(cfg)
    routed = count.components["routed_experts"][0]
    return routed * stored.routed_bytes + (count.total - routed) * stored.other_bytes


def _weight_groups(cfg: K3Config, batch: int) -> dict[str, tuple[float, float]]:
    """{group: (parameters held, parameters one decode step of ``batch`` sequences reads)} for the three groups a
    placement treats differently: "routed" (the routed experts: all held, the touched ones read), "moe_replicated"
    (router, shared experts, latent projections) and "rest" (attention, dense layers, norms, embedding, head: the
    embedding's read is the batch's rows, :func:`decode_weight_params`)."""
    count = param_count(cfg)
    routed_total = count.components["routed_experts"][0]
    moe_replicated = sum(count.components[name][0] for name in MOE_REPLICATED)
    read = decode_weight_params(cfg, batch)
    routed_read = _touched_expert_params(cfg, batch)
    rest_total = count.total - routed_total - moe_replicated
    return {"routed": (routed_total, routed_read), "moe_replicated": (moe_replicated, moe_replicated),
            "rest": (rest_total, read - routed_read - moe_replicated)}


def per_gpu_weight_bytes(cfg: K3Config, gpus: int, batch: int, precision: str = RELEASED_PRECISION,
                         placement: str = "expert-parallel") -> tuple[float, float]:
    """(bytes of weights one GPU holds, bytes of weights one GPU reads per decode step of ``batch`` sequences) on
    ``gpus`` GPUs under ``placement`` (:data:`PLACEMENTS`): a split group counts 1/N of its bytes, a replicated
    one all of them on every GPU.

    sharded          (routed + replicated + rest) / N
    expert-parallel  routed / N + moe_replicated + rest / N
    dp-attention     routed / N + moe_replicated + rest
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if not is_number(gpus) or gpus < 1:
        raise ValueError(f"gpus must be a positive int, got {gpus!r}")
    _, stored = _gpu_and_precision("H100", precision)
    groups = _weight_groups(cfg, batch)
    replicated = {"sharded": (), "expert-parallel": ("moe_replicated",),
                  "dp-attention": ("moe_replicated", "rest")}[placement]
    held = read = 0.0
    for group, (total, touched) in groups.items():
        share = 1 if group in replicated else 1 / gpus
        per_weight = stored.routed_bytes if group == "routed" else stored.other_bytes
        held += total * per_weight * share
        read += touched * per_weight * share
    return held, read


def decode_usd_per_million(step_s: float, batch: int, gpus: int, usd_per_gpu_hour: float) -> float:
    """Dollars per million output tokens of ``gpus`` GPUs rented at ``usd_per_gpu_hour`` that decode one token
    for each of ``batch`` sequences every ``step_s`` seconds:

    $ / 1M = 10⁶ · gpus · usd_per_gpu_hour / 3600 · step_s / batch
    """
    for name, value in (("step_s", step_s), ("usd_per_gpu_hour", usd_per_gpu_hour)):
        if not is_number(value, int | float) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    for name, value in (("batch", batch), ("gpus", gpus)):
        if not is_number(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return 1e6 * gpus * usd_per_gpu_hour / 3600 * step_s / batch


@dataclass(frozen=True)
class ServingCost:
    """What serving ``cfg`` on ``gpus`` GPUs costs: ``batch`` sequences of ``context`` tokens decoded together,
    each step ``step_s`` long; dollars per million input (prefill) and output (decode) tokens; ``weights_gpus``:
    how many of these GPUs the weights alone fill (stored once); ``placement``: where the weights sit
    (:data:`PLACEMENTS`); ``read_per_gpu``: the bytes one GPU reads per decode step (weights and caches)."""

    gpus: int
    batch: int
    context: int
    step_s: float
    weights_gpus: float
    usd_per_million_input: float
    usd_per_million_output: float
    placement: str
    read_per_gpu: float


def serving_cost(cfg: K3Config, gpu: GPU | str = "B300", precision: str = RELEASED_PRECISION,
                 usd_per_gpu_hour: float = 5.0, gpus: int | None = None, context: int = 32768,
                 batch: int | None = None, utilisation: float = 0.5, placement: str = "expert-parallel"
                 ) -> ServingCost:
    """A roofline price of serving ``cfg``, with every assumption an argument:

    weights    routed experts and the rest at their bytes per weight (:data:`WEIGHT_PRECISIONS`; default the
               release's MXFP4), placed on the GPUs by ``placement`` (:data:`PLACEMENTS`; default lesson 13's
               expert-parallel layout, router, shared experts and latent projections on every GPU):
               :func:`per_gpu_weight_bytes`. ``gpus`` default: the fewest whose usable memory (MEMORY_USABLE of
               HBM) holds each GPU's weights and one sequence
    batch      default: the most sequences of ``context`` tokens whose caches fit beside the weights, the caches
               spread evenly over the GPUs
    decode     one step of the batch on the busiest-read GPU: max(bytes read per GPU / bandwidth,
               FLOPs / (gpus · FLOP/s)) / utilisation, bytes read per GPU = its weights' reads (the experts the
               batch touches, :func:`decode_weight_params`) + batch · cache(context) / gpus (MLA latents bf16, KDA
               state fp32); $ per 1M output tokens by :func:`decode_usd_per_million`
    prefill    compute-bound: FLOPs per input token of a ``context``-token prompt (:func:`prefill_flops` / L) at
               the products' FLOP/s · utilisation; $ per 1M input tokens at the same price

    Communication (the all-to-all of expert parallelism) is left out: it can overlap with the experts' work.
    """
    gpu, stored = _gpu_and_precision(gpu, precision)
    if not is_number(utilisation, int | float) or not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must be in (0, 1], got {utilisation!r}")
    if not is_number(usd_per_gpu_hour, int | float) or not 0 < usd_per_gpu_hour < math.inf:
        raise ValueError(f"usd_per_gpu_hour must be a finite number > 0, got {usd_per_gpu_hour!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    per_sequence = kv_cache_bytes(cfg, context, CACHE_BYTES)
    usable = gpu.memory * MEMORY_USABLE
    held = lambda n: per_gpu_weight_bytes(cfg, n, 1, precision, placement)[0]
    if gpus is None:
        gpus = next((n for n in range(1, 1 << 16) if held(n) + per_sequence / n <= usable), None)
        if gpus is None:
            raise ValueError(f"placement: {placement} puts more than one {gpu.name} holds on every GPU")
    elif not is_number(gpus) or gpus < 1:
        raise ValueError(f"gpus must be a positive int or None, got {gpus!r}")
    free = gpus * (usable - held(gpus))
    most = int(free // per_sequence) if free > 0 else 0
    if most < 1:
        raise ValueError(f"gpus: {gpus} {gpu.name} hold {usable / GIB:.0f} GiB usable each, less than the "
                         f"{precision} weights each holds ({held(gpus) / GIB:.0f} GiB, {placement}) and one "
                         f"{context}-token sequence")
    if batch is None:
        batch = most
    elif not is_number(batch) or batch < 1:
        raise ValueError(f"batch must be a positive int or None, got {batch!r}")
    elif batch > most:
        raise ValueError(f"batch: {batch} sequences of {context} tokens do not fit beside the weights; at most {most}")
    read = per_gpu_weight_bytes(cfg, gpus, batch, precision, placement)[1] + batch * per_sequence / gpus
    step_flops = batch * decode_flops_per_token(cfg, context)
    step_s = max(read / gpu.bandwidth, step_flops / (gpus * gpu.flops[stored.products])) / utilisation
    prefill_s_per_token = prefill_flops(cfg, context) / context / (gpu.flops[stored.products] * utilisation)
    return ServingCost(gpus, batch, context, step_s, weight_bytes(cfg, precision) / gpu.memory,
                       1e6 * prefill_s_per_token * usd_per_gpu_hour / 3600,
                       decode_usd_per_million(step_s, batch, gpus, usd_per_gpu_hour), placement, read)
