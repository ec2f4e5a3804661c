"""``K3Config``: the dimensions of a K3-style model, its presets, and its accounting.

One dataclass describes every model in the course, from the four reference models (DeepSeek-V3, Kimi K2,
Kimi Linear 48B, Kimi K3) down to the ``tiny`` and ``small`` presets that train on a laptop CPU.
The accounting methods answer three questions from the dimensions alone (lessons 00 and 11):

- how many parameters, total and active per token, and where they live (``param_count``);
- how much memory decoding keeps per sequence: the MLA latent cache grows with every token, the KDA state is
  a constant (``kv_cache_bytes_per_token``, ``recurrent_state_bytes``, ``kv_cache_bytes``);
- what fraction of the routed experts a token uses (``activation_ratio``);
- roughly how many FLOPs decoding one token costs at a given context (``decode_flops_per_token``).

``meta_param_count`` counts the same model a second, independent way: it builds the real ``K3Model`` on the
meta device (shapes, no memory) and sums its parameters' ``numel`` by component.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

ROUTER_SCORES = ("sigmoid", "softmax")
BALANCING = ("quantile", "sign", "aux_loss", "none")
FFN_ACTIVATIONS = ("swiglu", "situ_glu")
RESIDUALS = ("prenorm", "block_attnres")
KDA_OUTPUT_GATES = ("full", "low_rank")


@dataclass(frozen=True)
class K3Config:
    """The dimensions of a K3-style decoder. Defaults are the ``tiny`` preset.

    Layers are numbered from 0. Layer ``i`` mixes tokens with KDA or MLA (``layer_types()``) and then runs a
    dense FFN (``i < first_k_dense``) or an MoE (``ffn_types()``).

    Attention schedule: with ``kda_per_mla = r``, every (r+1)-th layer is MLA and so is the last layer
    (K3: 93 layers, 69 KDA + 24 MLA); ``r = 0`` is all-MLA. ``mla_layers``, when given, lists the MLA layers
    explicitly and overrides the ratio (``()`` is all-KDA).

    MoE: ``n_routed_experts`` experts, ``top_k`` chosen per token, ``n_shared_experts`` always on. Each
    routed expert is a gated MLP ``expert_in → expert_dim → expert_in`` where ``expert_in`` is
    ``latent_dim`` (latent MoE: tokens are projected down to ℓ before dispatch) or ``d_model`` when
    ``latent_dim`` is None. The shared experts are one fused gated MLP ``d_model → n_shared·expert_dim``.
    """

    name: str = "tiny"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    first_k_dense: int = 1
    # attention schedule
    kda_per_mla: int = 3
    mla_layers: tuple[int, ...] | None = None
    # Kimi Delta Attention
    kda_n_heads: int = 4
    kda_head_dim: int = 32
    kda_conv_size: int = 4  # depthwise causal short convolution on q, k, v
    kda_output_gate: str = "full"  # K3: full-rank d → H·V; Kimi Linear: low rank d → K → H·V (with a bias)
    kda_lower_bound: float | None = -5.0  # K3's bounded gate g ∈ (−5, 0); None: Kimi Linear's unbounded gate
    # (gated) multi-head latent attention
    mla_n_heads: int = 4
    q_lora_rank: int | None = 64  # None: queries projected directly from d_model (Kimi Linear)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mla_gated: bool = True  # K3's output gate y = W_o[σ(W_g x) ⊙ attn]
    # mixture of experts
    n_routed_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 1
    expert_dim: int = 128
    latent_dim: int | None = 64
    dense_ffn_dim: int = 256  # width of the FFN in the first first_k_dense layers
    router_score: str = "sigmoid"
    route_scale: float = 1.0  # multiplies the renormalised top-k weights
    balancing: str = "quantile"  # quantile (K3), sign (DeepSeek-V3 bias rule), aux_loss (Switch), none
    z_loss_weight: float = 0.0  # weight of the router z-loss in the training loss (0: off)
    # block structure
    ffn_activation: str = "situ_glu"
    residual: str = "block_attnres"
    attnres_block_size: int = 4  # SUB-layers per Block AttnRes block, 2 per decoder layer (K3: 24 = 12 layers)
    context_length: int = 256  # longest context the model is meant for (tokens)
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)

    # --- construction -----------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> K3Config:
        """The named configuration; one of ``PRESETS`` (reference models and course presets)."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a preset name (str), got {type(name).__name__}")
        if name not in _PRESETS:
            raise ValueError(f"name: unknown preset {name!r}; valid presets are {', '.join(_PRESETS)}")
        return cls(**_PRESETS[name])

    def replace(self, **changes) -> K3Config:
        """A copy with some fields changed (validated like a new config)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"changes: {', '.join(unknown)} are not K3Config fields")
        return dataclasses.replace(self, **changes)

    def all_mla(self) -> K3Config:
        """The same model with every layer MLA (the baseline of the hybrid's KV-cache saving)."""
        return self.replace(name=f"{self.name} (all-MLA)", mla_layers=tuple(range(self.n_layers)))

    # --- layer schedule ---------------------------------------------------------------------------------

    def layer_types(self) -> tuple[str, ...]:
        """``"kda"`` or ``"mla"`` for each layer, in order (``mla_layers`` when given, else the ratio)."""
        if self.mla_layers is not None:
            return tuple("mla" if i in self.mla_layers else "kda" for i in range(self.n_layers))
        return layer_schedule(self.n_layers, self.kda_per_mla, self.first_k_dense)[0]

    def ffn_types(self) -> tuple[str, ...]:
        """``"dense"`` for the first ``first_k_dense`` layers, ``"moe"`` after."""
        return layer_schedule(self.n_layers, self.kda_per_mla, self.first_k_dense)[1]

    @property
    def n_mla_layers(self) -> int:
        return self.layer_types().count("mla")

    @property
    def n_kda_layers(self) -> int:
        return self.layer_types().count("kda")

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.first_k_dense

    # --- accounting -------------------------------------------------------------------------------------

    def param_count(self) -> ParamCount:
        """Total and active (per token) parameters, with a per-component breakdown.

        Active = everything a token touches: all weights except the routed experts it was not sent to
        (``top_k`` of ``n_routed_experts`` per MoE layer). Balancing biases are buffers, not parameters.
        """
        return ParamCount.from_components(_component_counts(self))

    def activation_ratio(self) -> float:
        """Routed experts active per token over routed experts: ``top_k / n_routed_experts``."""
        return self.top_k / self.n_routed_experts

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes the decoding cache GROWS by per token: MLA layers only.

        Each MLA layer caches its compressed latent c_KV and the shared rope key per token:
        ``n_mla_layers · (kv_lora_rank + qk_rope_head_dim) · dtype_bytes`` (K3: 24 · 576 · 2 B).
        KDA layers add nothing per token: their state is constant (``recurrent_state_bytes``).
        """
        _check_dtype_bytes(dtype_bytes)
        return self.n_mla_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes

    def recurrent_state_bytes(self, dtype_bytes: int = 2, state_bytes: int = 4) -> int:
        """Bytes of the KDA state, CONSTANT in the context length.

        Per KDA layer: the state S ∈ R^{H×K×V}, kept in fp32 (``state_bytes`` = 4) whatever the activations'
        dtype, plus the short-conv tails, the last ``conv_size − 1`` inputs of the q, k and v convolutions in the
        activations' dtype: ``H·K·V·state_bytes + (conv_size − 1)·(2·H·K + H·V)·dtype_bytes``.
        """
        _check_dtype_bytes(dtype_bytes)
        _check_dtype_bytes(state_bytes)
        heads, width = self.kda_n_heads, self.kda_head_dim
        state = heads * width * width * state_bytes
        conv_tails = (self.kda_conv_size - 1) * 3 * heads * width * dtype_bytes
        return self.n_kda_layers * (state + conv_tails)

    def kv_cache_bytes(self, context: int, dtype_bytes: int = 2) -> int:
        """Decoding memory for one sequence of ``context`` tokens:
        ``context · kv_cache_bytes_per_token + recurrent_state_bytes`` (growing part + constant part)."""
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise ValueError(f"context must be a token count (int ≥ 0), got {context!r}")
        return context * self.kv_cache_bytes_per_token(dtype_bytes) + self.recurrent_state_bytes(dtype_bytes)

    def decode_flops_per_token(self, context: int) -> int:
        """Approximate FLOPs to decode one token with ``context`` tokens already cached.

        weights   2 · (active parameters − the embedding table)    (a multiply-add per weight; lookup is free)
        MLA       2 · H · (2·kv_lora_rank + rope) · context per MLA layer: absorbed decoding scores each cached
                  576-wide entry (kv_lora + rope) and mixes the kv_lora-wide latents
        KDA       7 · H · K · V per KDA layer: decay, Sᵀk, the rank-1 delta update, Sᵀq; constant in context
        """
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise ValueError(f"context must be a token count (int ≥ 0), got {context!r}")
        count = self.param_count()
        weights = 2 * (count.active - count.components["embedding"][1])
        mla = self.n_mla_layers * 2 * self.mla_n_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim) * context
        kda = self.n_kda_layers * 7 * self.kda_n_heads * self.kda_head_dim ** 2
        return weights + mla + kda


def layer_schedule(n_layers: int, kda_per_mla: int, first_k_dense: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The layer plan: (mixer per layer, FFN per layer).

    Mixers: with r = kda_per_mla, layer i is "mla" when (i + 1) is a multiple of r + 1 or i is the last layer,
    "kda" otherwise (r = 0: every layer "mla"). FFNs: "dense" for i < first_k_dense, "moe" after.
    K3 (93 layers, r = 3, 1 dense): KDA KDA KDA MLA … MLA, 69 KDA + 24 MLA, layer 0 dense.
    """
    if kda_per_mla == 0:
        mixers = ("mla",) * n_layers
    else:
        mixers = tuple("mla" if (i + 1) % (kda_per_mla + 1) == 0 or i == n_layers - 1 else "kda"
                       for i in range(n_layers))
    return mixers, tuple("dense" if i < first_k_dense else "moe" for i in range(n_layers))


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
    d·K + K·HK + HK (low rank, the second map with a bias); per-head output RMSNorm K; output projection HK·d.
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
        output_gate = _linear(d, width) + _linear(width, inner) + inner  # the second map has a bias (fla)
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
    sub-layer (2 per layer) and one for the final aggregation, each of width d."""
    d = cfg.d_model
    norms = 2 * cfg.n_layers * d + d
    queries = (2 * cfg.n_layers + 1) * d if cfg.residual == "block_attnres" else 0
    return norms + queries


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
    from k3course.attention.kda import KimiDeltaAttention
    from k3course.attention.mla import GatedMLA
    from k3course.moe.experts import GLUFFN
    from k3course.moe.layers import MoE

    builders = {"kda": KimiDeltaAttention.from_config, "mla": GatedMLA.from_config, "moe": MoE.from_config,
                "dense_ffn": lambda c: GLUFFN(c.d_model, c.dense_ffn_dim, c.ffn_activation)}
    if kind not in builders:
        raise ValueError(f"kind: unknown layer kind {kind!r}; choose one of {', '.join(builders)}")
    with torch.device("meta"):
        return builders[kind](cfg)


def meta_param_count(cfg: K3Config) -> dict[str, tuple[int, int]]:
    """{component: (total, active)} counted from :class:`k3course.model.K3Model` built on the meta device
    (shapes, no memory: the full K3 in seconds), plus "total" and "active" as ints. Equal to
    :meth:`K3Config.param_count` by construction — a test holds them together for every preset."""
    _require_config(cfg)
    from k3course.model import K3Model  # the model is built from this config: imported here, not at the top

    parts = K3Model.from_config(cfg, device="meta").param_breakdown()
    return {**parts, "total": sum(t for t, _ in parts.values()), "active": sum(a for _, a in parts.values())}


# --- validation -----------------------------------------------------------------------------------------

def _require_config(cfg) -> None:
    if not isinstance(cfg, K3Config):
        raise TypeError(f"cfg must be a K3Config (e.g. K3Config.preset('tiny')), got {type(cfg).__name__}")


def _check_dtype_bytes(dtype_bytes: int) -> None:
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be a positive int (2 for bf16, 4 for fp32), got {dtype_bytes!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_POSITIVE = ("vocab_size", "d_model", "n_layers", "kda_n_heads", "kda_head_dim", "kda_conv_size", "mla_n_heads",
             "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "top_k", "expert_dim",
             "dense_ffn_dim", "attnres_block_size", "context_length")
_NON_NEGATIVE = ("first_k_dense", "kda_per_mla", "qk_rope_head_dim", "n_shared_experts")
_CHOICES = {"router_score": ROUTER_SCORES, "balancing": BALANCING, "ffn_activation": FFN_ACTIVATIONS,
            "residual": RESIDUALS, "kda_output_gate": KDA_OUTPUT_GATES}


def _check_fields(cfg: K3Config) -> None:
    """Raise a TypeError / ValueError naming the first field that is out of range."""
    if not isinstance(cfg.name, str):
        raise TypeError(f"name must be a str, got {type(cfg.name).__name__}")
    for field_name in _POSITIVE + _NON_NEGATIVE:
        value = getattr(cfg, field_name)
        if not _is_int(value):
            raise TypeError(f"{field_name} must be an int, got {value!r}")
        if value < (1 if field_name in _POSITIVE else 0):
            bound = "≥ 1" if field_name in _POSITIVE else "≥ 0"
            raise ValueError(f"{field_name} must be {bound}, got {value}")
    for field_name in ("q_lora_rank", "latent_dim"):
        value = getattr(cfg, field_name)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{field_name} must be None or an int ≥ 1, got {value!r}")
    for field_name, choices in _CHOICES.items():
        if getattr(cfg, field_name) not in choices:
            raise ValueError(f"{field_name} must be one of {', '.join(choices)}, got {getattr(cfg, field_name)!r}")
    for field_name in ("mla_gated", "tie_embeddings"):
        if not isinstance(getattr(cfg, field_name), bool):
            raise TypeError(f"{field_name} must be a bool, got {getattr(cfg, field_name)!r}")
    if isinstance(cfg.z_loss_weight, bool) or not isinstance(cfg.z_loss_weight, int | float) or cfg.z_loss_weight < 0:
        raise ValueError(f"z_loss_weight must be a number ≥ 0, got {cfg.z_loss_weight!r}")
    if isinstance(cfg.route_scale, bool) or not isinstance(cfg.route_scale, int | float) or cfg.route_scale <= 0:
        raise ValueError(f"route_scale must be a number > 0, got {cfg.route_scale!r}")
    if cfg.first_k_dense > cfg.n_layers:
        raise ValueError(f"first_k_dense must be ≤ n_layers ({cfg.n_layers}), got {cfg.first_k_dense}")
    if cfg.top_k > cfg.n_routed_experts:
        raise ValueError(f"top_k must be ≤ n_routed_experts ({cfg.n_routed_experts}), got {cfg.top_k}")
    if cfg.mla_layers is not None:
        _check_mla_layers(cfg.mla_layers, cfg.n_layers)
    bound = cfg.kda_lower_bound
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int | float) or not bound < 0):
        raise ValueError(f"kda_lower_bound must be None or a negative number, got {bound!r}")


def _check_mla_layers(mla_layers, n_layers: int) -> None:
    if not isinstance(mla_layers, tuple) or not all(_is_int(i) for i in mla_layers):
        raise TypeError(f"mla_layers must be None or a tuple of layer indices, got {mla_layers!r}")
    if any(not 0 <= i < n_layers for i in mla_layers) or len(set(mla_layers)) != len(mla_layers):
        raise ValueError(f"mla_layers must hold distinct indices in [0, n_layers={n_layers}), got {mla_layers}")
    if list(mla_layers) != sorted(mla_layers):
        raise ValueError(f"mla_layers must be sorted, got {mla_layers}")


# --- presets (lesson 11) --------------------------------------------------------------------------------

_REFERENCE_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
# All-MLA models have no KDA layer; their KDA fields are set as Kimi Linear sets them (as many KDA heads as MLA
# heads, head dim 128, low-rank output gate), so a hybrid variant, e.g. preset("kimi-k2").replace(kda_per_mla=3),
# is a meaningful what-if. They count nothing while every layer is MLA.
_ALL_MLA_PRENORM = dict(kda_per_mla=0, mla_gated=False, ffn_activation="swiglu", residual="prenorm",
                        kda_head_dim=128, kda_output_gate="low_rank", kda_lower_bound=None)

_PRESETS: dict[str, dict] = {
    "deepseek-v3": dict(
        name="deepseek-v3", vocab_size=129280, d_model=7168, n_layers=61, first_k_dense=3, mla_n_heads=128,
        kda_n_heads=128,
        **_REFERENCE_MLA, **_ALL_MLA_PRENORM, n_routed_experts=256, top_k=8, n_shared_experts=1, expert_dim=2048,
        latent_dim=None, dense_ffn_dim=18432, route_scale=2.5, balancing="sign", context_length=131072),
    "kimi-k2": dict(
        name="kimi-k2", vocab_size=163840, d_model=7168, n_layers=61, first_k_dense=1, mla_n_heads=64, kda_n_heads=64,
        **_REFERENCE_MLA, **_ALL_MLA_PRENORM, n_routed_experts=384, top_k=8, n_shared_experts=1, expert_dim=2048,
        latent_dim=None, dense_ffn_dim=18432, route_scale=2.827, balancing="sign", context_length=131072),
    "kimi-linear-48b": dict(
        name="kimi-linear-48b", vocab_size=163840, d_model=2304, n_layers=27, first_k_dense=1, kda_per_mla=3,
        kda_n_heads=32, kda_head_dim=128, kda_output_gate="low_rank", kda_lower_bound=None, mla_n_heads=32,
        q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_gated=False,
        n_routed_experts=256, top_k=8, n_shared_experts=1, expert_dim=1024, latent_dim=None, dense_ffn_dim=9216,
        route_scale=2.446, balancing="sign", ffn_activation="swiglu", residual="prenorm", context_length=1048576),
    "kimi-k3": dict(
        name="kimi-k3", vocab_size=163840, d_model=7168, n_layers=93, first_k_dense=1, kda_per_mla=3,
        kda_n_heads=96, kda_head_dim=128, kda_output_gate="full", mla_n_heads=96, **_REFERENCE_MLA, mla_gated=True,
        n_routed_experts=896, top_k=16, n_shared_experts=2, expert_dim=3072, latent_dim=3584,
        dense_ffn_dim=18432, route_scale=1.0, balancing="quantile", ffn_activation="situ_glu",
        residual="block_attnres", attnres_block_size=24, context_length=1048576),
    "tiny": dict(name="tiny"),
    "small": dict(
        name="small", vocab_size=256, d_model=256, n_layers=8, first_k_dense=1, kda_per_mla=3, kda_n_heads=4,
        kda_head_dim=64, mla_n_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=64, n_routed_experts=16, top_k=2, n_shared_experts=1, expert_dim=256, latent_dim=128,
        dense_ffn_dim=512, attnres_block_size=8, context_length=1024),
}

PRESETS: tuple[str, ...] = tuple(_PRESETS)

# Published (total, active) parameter counts the presets are checked against (lesson 00; K3 from secondary
# transcriptions of its report). "Active" conventions differ between reports; see notebooks/00_tour.ipynb.
PUBLISHED_PARAMS: dict[str, tuple[float, float]] = {
    "deepseek-v3": (671e9, 37e9),
    "kimi-k2": (1.04e12, 32.6e9),
    "kimi-linear-48b": (48e9, 3e9),
    "kimi-k3": (2.78e12, 104e9),
}
