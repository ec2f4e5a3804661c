"""``K3Config``: the dimensions of a K3-style model, their validation, and the presets (a leaf of the package).

One dataclass describes every model in the course, from the four reference models (DeepSeek-V3, Kimi K2,
Kimi Linear 48B, Kimi K3) down to the ``tiny`` and ``small`` presets that train on a laptop CPU. What a
config costs (parameters, cache bytes, FLOPs) is computed from it in :mod:`k3course.accounting`. The end of the
module reads any dataclass's fields from TOML and ``key=value`` text, typed and validated (``k3course train
--config / --set``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import types
import typing
from dataclasses import dataclass

from k3course.guards import is_number

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package (a dependency there)
    import tomli as tomllib

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
    ``latent_dim`` is None. The shared experts are one fused gated MLP ``d_model → n_shared_experts·expert_dim``.
    Group-limited routing (DeepSeek-V3): the experts form ``n_expert_groups`` equal groups, a group scores the
    sum of its two best biased scores, and a token picks its ``top_k`` among the ``topk_groups`` best groups.

    Settings the reference checkpoints need (:mod:`k3course.pretrained`) default to K3's choices, which are the
    course's behaviour: NoPE, one expert group, renormalised top-k, a bias on a low-rank KDA
    output gate. RoPE (``mla_rope``) rotates the ``qk_rope_head_dim`` dims of MLA by θ = ``rope_theta``, in
    half-split pairs (i, i + r/2) or, ``rope_interleaved``, in pairs (2i, 2i + 1) as DeepSeek checkpoints store
    them; ``rope_yarn_factor`` s > 1 turns on YaRN (DeepSeek-V3: s = 40 over a 4096-token original context):
    frequencies blended between θ^(-2i/r) and θ^(-2i/r)/s by the ramp between ``rope_yarn_beta_fast`` and
    ``rope_yarn_beta_slow`` rotations, cos and sin scaled by m(s, mscale)/m(s, mscale_all_dim) (m(s, 1) when
    either is 0) and the softmax scale by m(s, mscale_all_dim)² (1 when it is 0), m(s, μ) = 1 + 0.1·μ·ln s.

    Every RMSNorm's ε is ``norm_eps`` (the decoder's, MLA's q and latent norms, the latent MoE's norm, the AttnRes
    keys) except KDA's per-head output norm, which reads ``kda_norm_eps``: the course's presets keep 1e-6, the ε
    they were trained with; the released K3 and Kimi Linear use 1e-5 for both.
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
    kda_output_gate: str = "full"  # K3: full-rank d → H·V; Kimi Linear: low rank d → K → H·V
    kda_gate_bias: bool = True  # the low-rank output gate's second map has a bias (fla's layer; Kimi Linear: none)
    kda_lower_bound: float | None = -5.0  # K3's bounded gate g ∈ (−5, 0); None: Kimi Linear's unbounded gate
    # ε of the per-head output RMSNorm (K3 and Kimi Linear: rms_norm_eps = 1e-5; the course's presets: 1e-6). A
    # head's output RMS is ~5e-3 at course sizes (mean square ~2.5e-5), so 1e-5 instead of 1e-6 shrinks outputs by
    # tens of percent there; at full scale the choice matters far less.
    kda_norm_eps: float = 1e-6
    # (gated) multi-head latent attention
    mla_n_heads: int = 4
    q_lora_rank: int | None = 64  # None: queries projected directly from d_model (Kimi Linear)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mla_gated: bool = True  # K3's output gate y = W_o[σ(W_g x) ⊙ attn]
    mla_rope: bool = False  # rotate the rope dims (DeepSeek-V3, K2); False: NoPE (K3, Kimi Linear)
    rope_theta: float = 10000.0
    rope_interleaved: bool = False  # rotate pairs (2i, 2i + 1) (DeepSeek checkpoints) instead of (i, i + r/2)
    rope_yarn_factor: float | None = None  # YaRN's s (None: plain RoPE); see the class docstring
    rope_yarn_original_context: int = 4096
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 0.0  # 0: unset
    rope_yarn_mscale_all_dim: float = 0.0  # 0: unset
    # mixture of experts
    n_routed_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 1
    expert_dim: int = 128
    latent_dim: int | None = 64
    dense_ffn_dim: int = 256  # width of the FFN in the first first_k_dense layers
    router_score: str = "sigmoid"
    route_scale: float = 1.0  # multiplies the renormalised top-k weights
    renormalize_top_k: bool = True  # weights s_j / Σ_top-k s (False: the raw scores s_j)
    n_expert_groups: int = 1  # group-limited routing (DeepSeek-V3: 8 groups) ...
    topk_groups: int = 1  # ... of which each token uses the best topk_groups (DeepSeek-V3: 4)
    balancing: str = "quantile"  # quantile (K3), sign (DeepSeek-V3 bias rule), aux_loss (Switch), none
    z_loss_weight: float = 0.0  # weight of the router z-loss in the training loss (0: off)
    # block structure
    ffn_activation: str = "situ_glu"
    residual: str = "block_attnres"
    attnres_block_size: int = 4  # SUB-layers per Block AttnRes block, 2 per decoder layer (K3: 24 = 12 layers)
    attnres_key_weight: bool = False  # a learned RMSNorm weight on each AttnRes read's keys (K3's release: true)
    context_length: int = 256  # longest context the model is meant for (tokens)
    tie_embeddings: bool = False
    norm_eps: float = 1e-6  # ε of every RMSNorm but KDA's output norm (rms_norm_eps; see the class docstring)
    pad_token_id: int | None = None  # the embedding row that gets no gradient (nn.Embedding's padding_idx)

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

    @classmethod
    def from_dict(cls, fields: dict) -> K3Config:
        """The config of saved fields (:func:`from_saved_fields`: fields added since it was saved take their
        defaults, so old runs keep loading)."""
        return from_saved_fields(cls, fields)

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


# --- validation -----------------------------------------------------------------------------------------

_POSITIVE = ("vocab_size", "d_model", "n_layers", "kda_n_heads", "kda_head_dim", "kda_conv_size", "mla_n_heads",
             "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "top_k", "expert_dim",
             "dense_ffn_dim", "attnres_block_size", "context_length", "n_expert_groups", "topk_groups",
             "rope_yarn_original_context")
_NON_NEGATIVE = ("first_k_dense", "kda_per_mla", "qk_rope_head_dim", "n_shared_experts")
_CHOICES = {"router_score": ROUTER_SCORES, "balancing": BALANCING, "ffn_activation": FFN_ACTIVATIONS,
            "residual": RESIDUALS, "kda_output_gate": KDA_OUTPUT_GATES}


def _check_fields(cfg: K3Config) -> None:
    """Raise a TypeError / ValueError naming the first field that is out of range."""
    if not isinstance(cfg.name, str):
        raise TypeError(f"name must be a str, got {type(cfg.name).__name__}")
    for field_name in _POSITIVE + _NON_NEGATIVE:
        value = getattr(cfg, field_name)
        if not is_number(value):
            raise TypeError(f"{field_name} must be an int, got {value!r}")
        if value < (1 if field_name in _POSITIVE else 0):
            bound = "≥ 1" if field_name in _POSITIVE else "≥ 0"
            raise ValueError(f"{field_name} must be {bound}, got {value}")
    for field_name in ("q_lora_rank", "latent_dim"):
        value = getattr(cfg, field_name)
        if value is not None and (not is_number(value) or value < 1):
            raise ValueError(f"{field_name} must be None or an int ≥ 1, got {value!r}")
    for field_name, choices in _CHOICES.items():
        if getattr(cfg, field_name) not in choices:
            raise ValueError(f"{field_name} must be one of {', '.join(choices)}, got {getattr(cfg, field_name)!r}")
    for field_name in ("mla_gated", "tie_embeddings", "kda_gate_bias", "mla_rope", "rope_interleaved",
                       "renormalize_top_k", "attnres_key_weight"):
        if not isinstance(getattr(cfg, field_name), bool):
            raise TypeError(f"{field_name} must be a bool, got {getattr(cfg, field_name)!r}")
    for field_name in ("z_loss_weight", "rope_yarn_mscale", "rope_yarn_mscale_all_dim"):
        _check_number(cfg, field_name, "≥ 0")
    for field_name in ("route_scale", "norm_eps", "kda_norm_eps", "rope_theta", "rope_yarn_beta_fast",
                       "rope_yarn_beta_slow"):
        _check_number(cfg, field_name, "> 0")
    if cfg.rope_yarn_factor is not None:
        _check_number(cfg, "rope_yarn_factor", "> 0")
    if cfg.mla_rope and cfg.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even with mla_rope (RoPE rotates pairs), got "
                         f"{cfg.qk_rope_head_dim}")
    if cfg.pad_token_id is not None and (not is_number(cfg.pad_token_id) or not 0 <= cfg.pad_token_id < cfg.vocab_size):
        raise ValueError(f"pad_token_id must be None or a token id in [0, vocab_size = {cfg.vocab_size}), "
                         f"got {cfg.pad_token_id!r}")
    if cfg.first_k_dense > cfg.n_layers:
        raise ValueError(f"first_k_dense must be ≤ n_layers ({cfg.n_layers}), got {cfg.first_k_dense}")
    if cfg.top_k > cfg.n_routed_experts:
        raise ValueError(f"top_k must be ≤ n_routed_experts ({cfg.n_routed_experts}), got {cfg.top_k}")
    _check_groups(cfg)
    if cfg.mla_layers is not None:
        _check_mla_layers(cfg.mla_layers, cfg.n_layers)
    bound = cfg.kda_lower_bound
    if bound is not None and (not is_number(bound, int | float) or not bound < 0):
        raise ValueError(f"kda_lower_bound must be None or a negative number, got {bound!r}")


def _check_number(cfg: K3Config, field_name: str, bound: str) -> None:
    """``field_name`` is a real number ``> 0`` or ``≥ 0`` (``bound``)."""
    value = getattr(cfg, field_name)
    in_range = is_number(value, int | float) and (value > 0 or bound == "≥ 0" and value == 0)
    if not in_range:
        raise ValueError(f"{field_name} must be a number {bound}, got {value!r}")


def _check_groups(cfg: K3Config) -> None:
    """Group-limited routing: equal groups, at most all of them kept, enough experts in the kept groups."""
    groups, kept = cfg.n_expert_groups, cfg.topk_groups
    if cfg.n_routed_experts % groups:
        raise ValueError(f"n_expert_groups must divide n_routed_experts = {cfg.n_routed_experts}, got {groups}")
    if kept > groups:
        raise ValueError(f"topk_groups must be ≤ n_expert_groups = {groups}, got {kept}")
    if cfg.top_k > kept * cfg.n_routed_experts // groups:
        raise ValueError(f"top_k = {cfg.top_k} exceeds the experts in topk_groups = {kept} groups "
                         f"({kept * cfg.n_routed_experts // groups})")


def _check_mla_layers(mla_layers, n_layers: int) -> None:
    if not isinstance(mla_layers, tuple) or not all(is_number(i) for i in mla_layers):
        raise TypeError(f"mla_layers must be None or a tuple of layer indices, got {mla_layers!r}")
    if any(not 0 <= i < n_layers for i in mla_layers) or len(set(mla_layers)) != len(mla_layers):
        raise ValueError(f"mla_layers must hold distinct indices in [0, n_layers={n_layers}), got {mla_layers}")
    if list(mla_layers) != sorted(mla_layers):
        raise ValueError(f"mla_layers must be sorted, got {mla_layers}")


# --- presets (lesson 11) --------------------------------------------------------------------------------

_REFERENCE_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
# All-MLA models have no KDA layer; their KDA fields are set as Kimi Linear sets them (as many KDA heads as MLA
# heads, head dim 128, low-rank output gate without a bias, output-norm ε 1e-5), so a hybrid variant, e.g.
# preset("kimi-k2").replace(kda_per_mla=3), is a meaningful what-if. They count nothing while every layer is MLA.
_ALL_MLA_PRENORM = dict(kda_per_mla=0, mla_gated=False, ffn_activation="swiglu", residual="prenorm",
                        kda_head_dim=128, kda_output_gate="low_rank", kda_gate_bias=False, kda_lower_bound=None,
                        kda_norm_eps=1e-5)
# DeepSeek's RoPE: the rope rows interleaved, YaRN from a 4096-token pretraining context.
_DEEPSEEK_ROPE = dict(mla_rope=True, rope_interleaved=True, rope_yarn_original_context=4096, rope_yarn_mscale=1.0,
                      rope_yarn_mscale_all_dim=1.0)

# The reference presets carry their released config.json values (DeepSeek-V3 and Kimi Linear as transformers 5.23
# documents them; Kimi K2's RoPE (θ = 50000, YaRN ×32 with β 1 / 1) from its released config, recalled, not
# re-read here: an assumption). Kimi K3's ε (1e-5), dense FFN width (33 792) and AttnRes key-norm weights are the
# released config's and key map's as two public implementations read them (torchtitan PRs #4025, #4281; see
# notebooks/references.md).
_PRESETS: dict[str, dict] = {
    "deepseek-v3": dict(
        name="deepseek-v3", vocab_size=129280, d_model=7168, n_layers=61, first_k_dense=3, mla_n_heads=128,
        kda_n_heads=128,
        **_REFERENCE_MLA, **_ALL_MLA_PRENORM, n_routed_experts=256, top_k=8, n_shared_experts=1, expert_dim=2048,
        latent_dim=None, dense_ffn_dim=18432, route_scale=2.5, balancing="sign", context_length=131072,
        **_DEEPSEEK_ROPE, rope_theta=10000.0, rope_yarn_factor=40.0, rope_yarn_beta_fast=32.0,
        rope_yarn_beta_slow=1.0, n_expert_groups=8, topk_groups=4, norm_eps=1e-6),
    "kimi-k2": dict(
        name="kimi-k2", vocab_size=163840, d_model=7168, n_layers=61, first_k_dense=1, mla_n_heads=64, kda_n_heads=64,
        **_REFERENCE_MLA, **_ALL_MLA_PRENORM, n_routed_experts=384, top_k=8, n_shared_experts=1, expert_dim=2048,
        latent_dim=None, dense_ffn_dim=18432, route_scale=2.827, balancing="sign", context_length=131072,
        **_DEEPSEEK_ROPE, rope_theta=50000.0, rope_yarn_factor=32.0, rope_yarn_beta_fast=1.0,
        rope_yarn_beta_slow=1.0, norm_eps=1e-6),
    "kimi-linear-48b": dict(
        name="kimi-linear-48b", vocab_size=163840, d_model=2304, n_layers=27, first_k_dense=1, kda_per_mla=3,
        kda_n_heads=32, kda_head_dim=128, kda_output_gate="low_rank", kda_gate_bias=False, kda_lower_bound=None,
        kda_norm_eps=1e-5, mla_n_heads=32, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_gated=False,
        n_routed_experts=256, top_k=8, n_shared_experts=1, expert_dim=1024, latent_dim=None, dense_ffn_dim=9216,
        route_scale=2.446, balancing="sign", ffn_activation="swiglu", residual="prenorm", context_length=1048576,
        norm_eps=1e-5, pad_token_id=163839),
    "kimi-k3": dict(
        name="kimi-k3", vocab_size=163840, d_model=7168, n_layers=93, first_k_dense=1, kda_per_mla=3,
        kda_n_heads=96, kda_head_dim=128, kda_output_gate="full", mla_n_heads=96, **_REFERENCE_MLA, mla_gated=True,
        n_routed_experts=896, top_k=16, n_shared_experts=2, expert_dim=3072, latent_dim=3584,
        dense_ffn_dim=33792, route_scale=1.0, balancing="quantile", ffn_activation="situ_glu",
        residual="block_attnres", attnres_block_size=24, attnres_key_weight=True, context_length=1048576,
        norm_eps=1e-5, kda_norm_eps=1e-5),
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


# --- settings from text: TOML files and key=value overrides (k3course train --config / --set) ---------------

NONE_WORDS = ("none", "null")  # how TOML and the command line write None (TOML has no null)


def from_saved_fields(cls, fields: dict):
    """The dataclass ``cls`` of saved fields (``dataclasses.asdict``, read back from JSON): lists become tuples,
    fields left out take their defaults, unknown fields are a TypeError naming them; the class validates."""
    if not isinstance(fields, dict):
        raise TypeError(f"fields must be a dict of {cls.__name__} fields, got {type(fields).__name__}")
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise TypeError(f"fields: {', '.join(unknown)} are not {cls.__name__} fields")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def field_types(cls) -> dict[str, object]:
    """The annotation of each field of dataclass ``cls``, resolved (``int | None``, ``tuple[int, ...]``, ...)."""
    return typing.get_type_hints(cls)


def describe_type(annotation) -> str:
    """How an error names the type: ``int | None`` -> 'an int or "none"', ``tuple[int, ...]`` -> 'a list of ints'."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        return " or ".join(describe_type(a) for a in args if a is not type(None)) + ' or "none"'
    if typing.get_origin(annotation) is tuple:
        if args[-1] is Ellipsis:
            return f"a list of {describe_type(args[0]).split(' ', 1)[1]}s"
        return f"a list of {len(args)} {describe_type(args[0]).split(' ', 1)[1]}s"
    return {int: "an int", float: "a number", bool: "a bool (true or false)", str: "a string"}[annotation]


class _Mismatch(Exception):
    """A value that is not of the annotated type (turned into a ValueError naming the field)."""


def _convert(annotation, value):
    """``value`` as ``annotation``'s type, or raise :class:`_Mismatch`; ints are not bools, numbers become floats."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        if isinstance(value, str) and value.lower() in NONE_WORDS:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value)
    if typing.get_origin(annotation) is tuple:
        if isinstance(value, str) and args == (str, Ellipsis):
            value = [value]  # one path is a list of one
        if not isinstance(value, list | tuple) or (args[-1] is not Ellipsis and len(value) != len(args)):
            raise _Mismatch
        item_types = [args[0]] * len(value) if args[-1] is Ellipsis else args
        return tuple(_convert(a, v) for a, v in zip(item_types, value))
    if annotation is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if annotation is float and is_number(value):
        return float(value)
    if type(value) is not annotation:
        raise _Mismatch
    return value


def coerce_value(annotation, value, key: str):
    """``value`` (as TOML reads it) converted to the type ``annotation`` names; otherwise a ValueError naming
    ``key`` and the expected type. ``"none"`` is None for an optional field; a string is a list of one string."""
    try:
        return _convert(annotation, value)
    except _Mismatch:
        raise ValueError(f"{key} expects {describe_type(annotation)}, got {value!r}") from None


def toml_document(text: str) -> dict:
    """``text`` read as TOML; a ValueError saying where it is not TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"not valid TOML: {error}") from None


def _accepts_str(annotation) -> bool:
    return str in typing.get_args(annotation) or annotation is str


def value_from_text(annotation, text: str, key: str):
    """A command-line value (``--set key=TEXT``) read as a TOML value (``3``, ``1e-3``, ``true``, ``[0, 3]``,
    ``"x"``), or as the bare text when it is not one; for a string field the text itself (``name=123``)."""
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        value = text
    if (annotation is str or _accepts_str(annotation)) and not isinstance(value, str | list):
        value = text
    return coerce_value(annotation, value, key)


def check_field_names(cls, names, section: str, where: str) -> None:
    """A ValueError naming the first of ``names`` that is not a field of dataclass ``cls``, with the closest
    field names (or all of them)."""
    known = field_types(cls)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; its fields are {', '.join(known)}"
            raise ValueError(f"{where}: [{section}] has no field {name!r}{hint}")


def with_settings(obj, settings: dict, section: str, where: str):
    """A copy of dataclass instance ``obj`` with ``settings`` {field: value} converted to the fields' types and
    validated by its class. Errors are ValueErrors that begin with ``where`` (a file, a flag) and name
    ``section.field``: an unknown field (with the closest names), a wrong type, a value out of range."""
    known = field_types(type(obj))
    check_field_names(type(obj), settings, section, where)
    changes = {name: coerce_value(known[name], value, f"{section}.{name}") for name, value in settings.items()}
    try:
        return dataclasses.replace(obj, **changes)
    except (TypeError, ValueError) as error:
        first = str(error).split()[0]
        raise ValueError(f"{where}: {section}.{error}" if first in known else f"{where}: {section}: {error}") from error


def _toml_value(value) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    return repr(value)  # int, or float (repr gives TOML's 1e-05, inf, nan)


def toml_text(sections: dict[str, object]) -> str:
    """TOML for ``{section: dataclass instance}``: one table per section with every field (None as "none"),
    which :func:`with_settings` reads back to the same instances."""
    tables = []
    for section, obj in sections.items():
        rows = [f"{f.name} = {_toml_value(getattr(obj, f.name))}" for f in dataclasses.fields(obj)]
        tables.append(f"[{section}]\n" + "\n".join(rows) + "\n")
    return "\n".join(tables)
