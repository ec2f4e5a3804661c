"""Checkpoints: Kimi Linear and DeepSeek-V3 in transformers' layout, Kimi K3 in its released layout (configs and
reading; the names and shapes are :mod:`k3course.layout`'s one table).

A checkpoint is a folder with ``config.json`` and safetensors weights: one ``model.safetensors``, or shards listed
by ``model.safetensors.index.json``. Three families of model types are read:

    kimi_linear   Kimi-Linear-48B-A3B: KDA + NoPE MLA, sigmoid MoE with a shared expert
    deepseek_v3   DeepSeek-V3, Kimi K2 (``model_type`` "kimi_k2"), Moonlight: MLA with (YaRN) RoPE, grouped routing
    kimi_k3       Kimi K3's release: a nested ``text_config`` (:func:`k3_config_from_hf`), tensors under
                  ``language_model.model.`` (or ``model.`` in a text-only export; the vision tower skipped with
                  one printed line), routed experts in MXFP4 (compressed-tensors ``mxfp4-pack-quantized``)

The first two in both spellings of their keys:

released    the config.json keys and tensor names of the published checkpoints (Kimi Linear: ``linear_attn_config``
            with 1-indexed ``full_attn_layers``, ``num_experts``, per-expert ``w1 / w2 / w3``, ``q_conv1d``;
            DeepSeek: ``rope_scaling``, per-expert ``gate_proj / up_proj / down_proj``)
transformers  the names its config classes and modules use (``layer_types``, ``rope_parameters``; fused
            ``experts.gate_up_proj``, ``conv1d``, ``forget_gate.*``): :func:`stored_spellings`

Multi-token-prediction layers (index ≥ ``num_hidden_layers``) are skipped. FP8 releases (DeepSeek-V3, Kimi K2:
e4m3 weights with a ``weight_scale_inv`` per 128 × 128 block, ``quantization_config``) and K3's MXFP4 routed experts
are dequantized tensor by tensor as they are read (:func:`dequantize_fp8`, :func:`k3course.layout.unpack_mxfp4`);
every tensor's dtype is checked. What the course cannot express (INT4 compressed-tensors weights, another routing
function or activation, attention biases, another RoPE type, K3 settings other than its own) is refused with
:class:`UnsupportedCheckpoint` naming it. The way back is :mod:`k3course.pretrained_save`.

This module knows :class:`~k3course.model.K3Model`'s parameter names as strings and never imports the model:
``K3Model.from_pretrained`` builds it on the meta device and assigns what :meth:`PretrainedFolder.k3_tensors` yields,
one part at a time, read from memory-mapped files, so the weights are never in memory twice. The names and shapes
per layer are in :mod:`k3course.layout`.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from k3course import layout
from k3course.config import K3Config, layer_schedule
from k3course.guards import is_number

MODEL_TYPES = ("kimi_linear", "deepseek_v3", "kimi_k2", "kimi_k3")
# transformers' defaults for keys a config.json may leave out, where the two model types differ
DEFAULTS = {"kimi_linear": dict(n_group=1, topk_group=1, rms_norm_eps=1e-5, routed_scaling_factor=2.446),
            "deepseek_v3": dict(n_group=8, topk_group=4, rms_norm_eps=1e-6, routed_scaling_factor=2.5)}
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
CONFIG_FILE, SINGLE_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SCALE_SUFFIX = "_scale_inv"  # an FP8 release's block scales of tensor X.weight: X.weight_scale_inv
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
MOE_KEY = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.")
# What Kimi Linear's layers are, whatever the config: save_pretrained refuses a config that sets another value.
KIMI_LINEAR_FIXED = dict(residual="prenorm", ffn_activation="swiglu", router_score="sigmoid", mla_gated=False,
                         mla_rope=False, latent_dim=None, kda_output_gate="low_rank", kda_gate_bias=False,
                         kda_lower_bound=None)


class UnsupportedCheckpoint(ValueError):
    """A checkpoint, or a config to write as one, holding something the course cannot express (named)."""


# --- config.json -> K3Config ----------------------------------------------------------------------------------

_MISSING = object()


def _key(hf: dict, *names: str, default=_MISSING):
    """The value of the first of ``names`` that ``hf`` holds (not None): released and transformers spellings."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if default is _MISSING:
        raise UnsupportedCheckpoint(f"config.json: no {' / '.join(names)} (a required setting)")
    return default


def config_from_hf(hf: dict, name: str = "pretrained") -> K3Config:
    """The :class:`K3Config` of a checkpoint's config.json (released or transformers keys). Kimi Linear and
    DeepSeek: dense layers first, PreNorm, SwiGLU, sigmoid routing with a bias trained by DeepSeek's sign rule, no
    output gate on MLA. Kimi K3 (``kimi_k3``): :func:`k3_config_from_hf`."""
    if not isinstance(hf, dict) or hf.get("model_type") not in MODEL_TYPES:
        found = hf.get("model_type") if isinstance(hf, dict) else type(hf).__name__
        raise UnsupportedCheckpoint(f"model_type: {found!r} is not one of {', '.join(MODEL_TYPES)}")
    if hf["model_type"] == "kimi_k3":
        return k3_config_from_hf(hf, name)
    _refuse_unsupported(hf)
    kimi_linear = hf["model_type"] == "kimi_linear"
    specific = _kimi_linear_fields(hf) if kimi_linear else _deepseek_fields(hf)
    return K3Config(name=name, **_shared_fields(hf, DEFAULTS["kimi_linear" if kimi_linear else "deepseek_v3"]),
                    **specific)


def _refuse_unsupported(hf: dict) -> None:
    """Raise UnsupportedCheckpoint naming the first setting the course's layers cannot reproduce."""
    fp8_block_size(hf)
    checks = [("hidden_act", hf.get("hidden_act", "silu"), ("silu",)),
              ("attention_bias", hf.get("attention_bias", False), (False,)),
              ("moe_layer_freq", hf.get("moe_layer_freq", 1), (1,)),
              ("scoring_func", hf.get("scoring_func", "sigmoid"), ("sigmoid",)),
              ("moe_router_activation_func", hf.get("moe_router_activation_func", "sigmoid"), ("sigmoid",)),
              ("topk_method", hf.get("topk_method", "noaux_tc"), ("noaux_tc",)),
              ("mla_use_nope", hf.get("mla_use_nope", True), (True,))]
    for key, value, supported in checks:
        if value not in supported:
            raise UnsupportedCheckpoint(f"{key}: {value!r} is not supported (the course implements {supported[0]!r})")


def fp8_block_size(hf: dict) -> tuple[int, int] | None:
    """The (rows, columns) of the blocks that share one scale in an FP8 release (``quantization_config``:
    ``quant_method: "fp8"``, e4m3, ``weight_block_size``; DeepSeek-V3 and Kimi K2 use 128 × 128), or None for an
    unquantized checkpoint. Any other quantization is refused, naming it and what to do."""
    quantization = hf.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
    if method == "compressed-tensors":
        raise UnsupportedCheckpoint("quantization_config: 'compressed-tensors' (INT4 weights, as Kimi K2 Thinking "
                                    "ships them) is not supported; dequantize the checkpoint to bf16 first, or load "
                                    "an FP8 or bf16 release")
    if method != "fp8":
        raise UnsupportedCheckpoint(f"quantization_config: quant_method {method!r} is not supported (the course "
                                    "reads 'fp8' block scales); dequantize the checkpoint to bf16 first")
    block = quantization.get("weight_block_size")
    if quantization.get("fmt", "e4m3") != "e4m3" or not (
            isinstance(block, list | tuple) and len(block) == 2 and all(is_number(b) and b > 0 for b in block)):
        raise UnsupportedCheckpoint(f"quantization_config: expected fmt 'e4m3' and weight_block_size [rows, columns],"
                                    f" got fmt {quantization.get('fmt')!r}, weight_block_size {block!r}")
    return int(block[0]), int(block[1])


def _shared_fields(hf: dict, defaults: dict) -> dict:
    """The K3Config fields both model types spell alike (with their aliases); ``defaults`` for absent keys."""
    return dict(
        vocab_size=_key(hf, "vocab_size"), d_model=_key(hf, "hidden_size"), n_layers=_key(hf, "num_hidden_layers"),
        mla_n_heads=_key(hf, "num_attention_heads"), q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=_key(hf, "kv_lora_rank"), qk_nope_head_dim=_key(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=_key(hf, "qk_rope_head_dim"), v_head_dim=_key(hf, "v_head_dim"),
        dense_ffn_dim=_key(hf, "intermediate_size"), expert_dim=_key(hf, "moe_intermediate_size"),
        n_routed_experts=_key(hf, "num_experts", "n_routed_experts", "num_local_experts"),
        top_k=_key(hf, "num_experts_per_token", "num_experts_per_tok"),
        n_shared_experts=_key(hf, "num_shared_experts", "n_shared_experts", default=0),
        n_expert_groups=_key(hf, "num_expert_group", "n_group", default=defaults["n_group"]),
        topk_groups=_key(hf, "topk_group", default=defaults["topk_group"]),
        renormalize_top_k=_key(hf, "moe_renormalize", "norm_topk_prob", default=True),
        route_scale=float(_key(hf, "routed_scaling_factor", default=defaults["routed_scaling_factor"])),
        norm_eps=float(_key(hf, "rms_norm_eps", default=defaults["rms_norm_eps"])),
        context_length=_key(hf, "model_max_length", "max_position_embeddings", default=4096),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_token_id=hf.get("pad_token_id"),
        latent_dim=None, mla_gated=False, ffn_activation="swiglu", residual="prenorm", router_score="sigmoid",
        balancing="sign", kda_output_gate="low_rank", kda_gate_bias=False, kda_lower_bound=None)


def _kimi_linear_fields(hf: dict) -> dict:
    """KDA sizes, the layer schedule (``layer_types``, or the released 1-indexed ``linear_attn_config``) and the
    dense layers (``mlp_layer_types``, or ``first_k_dense_replace``)."""
    linear = hf.get("linear_attn_config") or {}
    n_layers = _key(hf, "num_hidden_layers")
    if hf.get("layer_types") is not None:
        mla_layers = tuple(i for i, kind in enumerate(hf["layer_types"]) if kind == "full_attention")
    elif "full_attn_layers" in linear:
        mla_layers = tuple(sorted(i - 1 for i in linear["full_attn_layers"]))
    else:  # transformers' default schedule
        mla_layers = tuple(i for i in range(n_layers) if i and i % 4 == 0)
    mlp_types = hf.get("mlp_layer_types")
    first_k_dense = hf.get("first_k_dense_replace", 1) if mlp_types is None else mlp_types.count("dense")
    if mlp_types is not None and list(mlp_types) != ["dense"] * first_k_dense + ["sparse"] * (n_layers - first_k_dense):
        raise UnsupportedCheckpoint(f"mlp_layer_types: dense layers must come first, got {mlp_types}")
    return dict(mla_layers=mla_layers, first_k_dense=first_k_dense,
                kda_n_heads=_key(linear, "num_heads", default=None) or _key(hf, "linear_num_heads", default=32),
                kda_head_dim=_key(linear, "head_dim", default=None) or _key(hf, "linear_head_dim", default=128),
                kda_conv_size=(_key(linear, "short_conv_kernel_size", default=None)
                               or _key(hf, "linear_conv_kernel_dim", default=4)),
                kda_norm_eps=float(_key(hf, "rms_norm_eps", default=1e-5)))


def _deepseek_fields(hf: dict) -> dict:
    """All layers MLA with RoPE (interleaved unless ``rope_interleave`` is false), the first
    ``first_k_dense_replace`` dense."""
    return dict(kda_per_mla=0, first_k_dense=_key(hf, "first_k_dense_replace", default=3), mla_rope=True,
                rope_interleaved=bool(hf.get("rope_interleave", True)), **_rope_fields(hf))


def _rope_fields(hf: dict) -> dict:
    """θ and YaRN from ``rope_parameters`` (transformers) or ``rope_theta`` + ``rope_scaling`` (released)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedCheckpoint(f"rope partial_rotary_factor: {rope['partial_rotary_factor']} is not supported")
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "yarn":
        raise UnsupportedCheckpoint(f"rope_type: {kind!r} is not supported (the course implements default and yarn)")
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise UnsupportedCheckpoint("rope_parameters: an explicit attention_factor or truncate=false is not supported")
    context = _key(hf, "max_position_embeddings", "model_max_length", default=4096)
    original = int(rope.get("original_max_position_embeddings") or context)
    return dict(rope_theta=theta, rope_yarn_factor=float(rope.get("factor") or context / original),
                rope_yarn_original_context=original, rope_yarn_beta_fast=float(rope.get("beta_fast") or 32),
                rope_yarn_beta_slow=float(rope.get("beta_slow") or 1), rope_yarn_mscale=float(rope.get("mscale") or 0),
                rope_yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0))


# --- Kimi K3's config.json: one table of keys, read here and written by pretrained_save ----------------------

# text_config key: K3Config field, the same value both ways
K3_TEXT_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layers",
    "intermediate_size": "dense_ffn_dim", "first_k_dense_replace": "first_k_dense",
    "num_attention_heads": "mla_n_heads",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "num_experts": "n_routed_experts",
    "num_experts_per_token": "top_k", "num_shared_experts": "n_shared_experts", "moe_intermediate_size": "expert_dim",
    "routed_expert_hidden_size": "latent_dim", "moe_renormalize": "renormalize_top_k",
    "routed_scaling_factor": "route_scale", "num_expert_group": "n_expert_groups", "topk_group": "topk_groups",
    "rms_norm_eps": "norm_eps", "max_position_embeddings": "context_length", "tie_word_embeddings": "tie_embeddings",
    "pad_token_id": "pad_token_id", "mla_use_output_gate": "mla_gated"}
K3_OPTIONAL = {"pad_token_id": None, "tie_word_embeddings": False}  # the text_config keys a config may leave out
# linear_attn_config key: K3Config field
K3_LINEAR_KEYS = {"num_heads": "kda_n_heads", "head_dim": "kda_head_dim", "short_conv_kernel_size": "kda_conv_size",
                  "gate_lower_bound": "kda_lower_bound"}
# what the K3 layout's layers are: text_config (or linear_attn_config) settings the course reads only at this value
K3_FIXED_KEYS = {"hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
                 "latent_moe_use_norm": True, "mla_use_nope": True, "moe_layer_freq": 1,
                 "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "use_grouped_topk": True}
K3_FIXED_LINEAR_KEYS = {"use_full_rank_gate": True}
# ... and the K3Config fields they make (save_pretrained(layout="kimi_k3") refuses a config that sets another)
K3_FIXED = dict(ffn_activation="situ_glu", router_score="sigmoid", mla_rope=False, kda_output_gate="full",
                residual="block_attnres", attnres_key_weight=True)
MXFP4_FORMAT = "mxfp4-pack-quantized"  # compressed-tensors' name for the release's routed experts
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
MULTIMODAL_PREFIX = "language_model."  # the release nests the text model: language_model.model.*, .lm_head


def k3_config_from_hf(hf: dict, name: str = "pretrained") -> K3Config:
    """The :class:`K3Config` of a ``kimi_k3`` config.json: the nested ``text_config`` (:data:`K3_TEXT_KEYS`,
    ``linear_attn_config`` with 1-indexed ``full_attn_layers``, ``attn_res_block_size`` in layers), K3's layers
    (:data:`K3_FIXED`), quantile balancing. UnsupportedCheckpoint names a setting the course cannot express."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedCheckpoint("config.json: model_type 'kimi_k3' needs a text_config object")
    linear = text.get("linear_attn_config")
    if not isinstance(linear, dict):
        raise UnsupportedCheckpoint("text_config: no linear_attn_config object (KDA's settings)")
    mxfp4_group(hf)
    for where, settings, fixed in (("text_config", text, K3_FIXED_KEYS),
                                   ("linear_attn_config", linear, K3_FIXED_LINEAR_KEYS)):
        for key, value in fixed.items():
            if key in settings and settings[key] != value:
                raise UnsupportedCheckpoint(f"{where}.{key}: {settings[key]!r} is not supported (the course "
                                            f"implements {value!r})")
    fields = {field: _key(text, key, default=K3_OPTIONAL.get(key, _MISSING)) for key, field in K3_TEXT_KEYS.items()}
    fields |= {field: _key(linear, key) for key, field in K3_LINEAR_KEYS.items()}
    block = _key(text, "attn_res_block_size")
    n_layers = fields["n_layers"]
    mla_layers = tuple(sorted(i - 1 for i in _key(linear, "full_attn_layers")))
    schedule = dict(kda_per_mla=3, mla_layers=None)
    if layer_schedule(n_layers, 3, fields["first_k_dense"])[0] != tuple(
            "mla" if i in mla_layers else "kda" for i in range(n_layers)):
        schedule["mla_layers"] = mla_layers
    return K3Config(name=name, **fields, **schedule, **K3_FIXED, attnres_block_size=2 * block,
                    kda_norm_eps=fields["norm_eps"], balancing="quantile")


def mxfp4_group(hf: dict) -> int | None:
    """The group size of a ``kimi_k3`` release's MXFP4 routed experts (``quantization_config``: compressed-tensors
    format ``mxfp4-pack-quantized``, 4-bit weights in groups of 32), or None when unquantized; anything else is
    refused, naming it."""
    quantization = hf.get("quantization_config")
    if not quantization:
        return None
    form = quantization.get("format") if isinstance(quantization, dict) else quantization
    if form != MXFP4_FORMAT:
        raise UnsupportedCheckpoint(f"quantization_config: format {form!r} is not supported (the course reads "
                                    f"{MXFP4_FORMAT!r}, the release's routed experts)")
    groups = quantization.get("config_groups") or {}
    sizes = {group.get("weights", {}).get("group_size") for group in groups.values() if isinstance(group, dict)}
    if sizes - {layout.MXFP4_GROUP}:
        raise UnsupportedCheckpoint(f"quantization_config: weight group_size {sorted(sizes - {32})} is not "
                                    f"supported (MXFP4 scales groups of {layout.MXFP4_GROUP})")
    return layout.MXFP4_GROUP


# --- tensors: transformers' names -> K3Model's names -------------------------------------------------------------

@dataclass
class _Source:
    """A checkpoint's tensors: ``get(key)``, their names ``keys``, the names read so far (``used``), and for an FP8
    release its block size and the ``dtype`` its weights are dequantized to as they are read."""

    get: Callable[[str], torch.Tensor]
    keys: set[str]
    used: set[str]
    block: tuple[int, int] | None = None
    dtype: torch.dtype = torch.float32
    mxfp4: bool = False

    def read(self, key: str) -> torch.Tensor:
        """Tensor ``key``, checked: a floating dtype, float8_e4m3fn dequantized with its ``_scale_inv``, or, in an
        MXFP4 release, ``key_packed`` and ``key_scale`` dequantized (:func:`~k3course.layout.unpack_mxfp4`)."""
        if key not in self.keys and self.mxfp4 and key + "_packed" in self.keys:
            return self._unpacked(key)
        if key not in self.keys:
            raise UnsupportedCheckpoint(f"checkpoint: tensor {key} is missing")
        self.used.add(key)
        tensor = self.get(key)
        if tensor.dtype == torch.float8_e4m3fn:
            return self._dequantized(key, tensor)
        if tensor.dtype not in FLOATING:
            raise UnsupportedCheckpoint(f"checkpoint: tensor {key} holds {str(tensor.dtype).removeprefix('torch.')}; "
                                        "expected float32, bfloat16 or float16 (or float8_e4m3fn with its scales)")
        return tensor

    def _unpacked(self, key: str) -> torch.Tensor:
        packed, scale = key + "_packed", key + "_scale"
        if scale not in self.keys:
            raise UnsupportedCheckpoint(f"checkpoint: tensor {packed} is MXFP4 but its scales {scale} are missing")
        self.used.update((packed, scale))
        try:
            return layout.unpack_mxfp4(self.get(packed), self.get(scale), self.dtype, key)
        except layout.LayoutError as error:
            raise UnsupportedCheckpoint(f"checkpoint: {error}") from error

    def _dequantized(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        scale_key = key + SCALE_SUFFIX
        if scale_key not in self.keys:
            raise UnsupportedCheckpoint(f"checkpoint: tensor {key} is float8_e4m3fn but its block scales {scale_key} "
                                        "are missing")
        if self.block is None:
            raise UnsupportedCheckpoint(f"checkpoint: tensor {key} is float8_e4m3fn but config.json has no "
                                        "quantization_config (quant_method 'fp8', weight_block_size)")
        return dequantize_fp8(weight, self.read(scale_key), self.block, self.dtype, key)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """W[i, j] = q[i, j] · s[⌊i / b₀⌋, ⌊j / b₁⌋], in fp32, returned in ``dtype``: ``weight`` q [m, n] e4m3,
    ``scale_inv`` s [⌈m / b₀⌉, ⌈n / b₁⌉] (the released name: the inverse of the scale that quantized the block),
    ``block`` (b₀, b₁). ``name`` is said when the shapes disagree."""
    rows, columns = block
    expected = tuple(-(-size // step) for size, step in zip(weight.shape, block)) if weight.dim() == 2 else None
    if expected is None or tuple(scale_inv.shape) != expected:
        raise UnsupportedCheckpoint(f"checkpoint: tensor {name} of shape {tuple(weight.shape)} needs block scales of "
                                    f"shape {expected} for {rows} × {columns} blocks, got {tuple(scale_inv.shape)}")
    m, n = weight.shape
    scale = scale_inv.float().repeat_interleave(rows, 0)[:m].repeat_interleave(columns, 1)[:, :n]
    return (weight.float() * scale).to(dtype)


def stored_spellings(keys) -> Callable[[int], layout.Spelling]:
    """Which spelling (:class:`~k3course.layout.Spelling`) each decoder layer of a checkpoint with tensors ``keys``
    uses: its FFN under ``block_sparse_moe.`` (Kimi Linear's released MoE layers, and every FFN transformers writes
    for Kimi Linear) or ``mlp.``; per-expert w1|w3|w2, gate|up|down_proj or transformers' fused experts; split or
    stacked KDA convolutions; KDA's forget gate at the attention's top or under ``forget_gate.``."""
    keys = set(keys)
    moe_layers = {match.group(1) for key in keys if (match := MOE_KEY.match(key))}

    def spelling(i: int) -> layout.Spelling:
        layer = f"model.layers.{i}."
        ffn = "block_sparse_moe." if str(i) in moe_layers else "mlp."
        experts = ("fused" if f"{layer}{ffn}experts.gate_up_proj" in keys
                   else "w" if {f"{layer}{ffn}experts.0.w1.weight", f"{layer}{ffn}experts.0.w1.weight_packed"} & keys
                   else "proj")
        return layout.Spelling(dense=ffn, moe=ffn, experts=experts,
                               conv="stacked" if f"{layer}self_attn.conv1d.weight" in keys else "split",
                               gate="forget_gate." if f"{layer}self_attn.forget_gate.A_log" in keys else "")
    return spelling


def k3_tensors(get: Callable[[str], torch.Tensor], keys, cfg: K3Config, fp8_block: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32, mxfp4: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """{K3Model name: tensor} of a checkpoint's tensors ``get(key)`` (names ``keys``, in the layout
    :func:`k3course.layout.checkpoint_layout` gives ``cfg``, each layer in the spelling it uses), one part at a
    time: the embedding, each decoder layer, the AttnRes reads, the final norm and head. FP8 weights (blocks
    ``fp8_block``) and MXFP4 routed experts (``mxfp4``) are dequantized to ``dtype`` as they are read. Raises
    UnsupportedCheckpoint naming a missing tensor, one of another shape or dtype, or at the end the tensors
    nothing read (MTP layers, index ≥ n_layers, are skipped)."""
    keys, used = set(keys), set()
    source = _Source(get, keys, used, fp8_block, dtype, mxfp4)
    try:
        for part in layout.checkpoint_layout(cfg, stored_spellings(keys)):
            yield {name: tensor for row in part for name, tensor in row.read(source.read, cfg).items()}
    except layout.LayoutError as error:
        raise UnsupportedCheckpoint(str(error)) from error
    if not cfg.n_shared_experts:
        _no_shared_experts(source, cfg)
    if cfg.tie_embeddings:
        used.add(HEAD)  # a tied head may be stored too; PretrainedFolder unties a config whose stored head differs
    unread = sorted(k for k in keys - used if not _is_mtp(k, cfg.n_layers))
    if unread:
        raise UnsupportedCheckpoint(f"checkpoint: {len(unread)} tensors the course cannot place, e.g. {unread[:4]}")


def convert_state(tensors: dict[str, torch.Tensor], cfg: K3Config) -> dict[str, torch.Tensor]:
    """:func:`k3_tensors` of tensors in memory ({transformers name: tensor}), all at once."""
    return {name: t for part in k3_tensors(tensors.__getitem__, tensors.keys(), cfg) for name, t in part.items()}


def _is_mtp(key: str, n_layers: int) -> bool:
    match = LAYER_KEY.match(key)
    return match is not None and int(match.group(1)) >= n_layers


def _no_shared_experts(source: _Source, cfg: K3Config) -> None:
    """With ``n_shared_experts: 0`` transformers still writes the shared expert, with no rows: read it and check
    that it is empty (nothing to place)."""
    for key in sorted(source.keys):
        if ".shared_experts." in key and source.read(key).numel():
            raise UnsupportedCheckpoint(f"checkpoint: tensor {key} is not empty, but config.json has "
                                        "n_shared_experts 0")


class PretrainedFolder:
    """A Hugging Face checkpoint folder (a training run's checkpoints are :mod:`k3course.checkpoint`'s): its
    :class:`K3Config` (``config``), the raw config.json (``hf_config``) and its tensors, read one at a time from
    memory-mapped safetensors files (:meth:`k3_tensors`). Checked on opening, before any weight is read: the
    folder, config.json, the index against its shards, every file's safetensors header, and the head: a stored
    ``lm_head`` that differs from the embedding is the head, whatever ``tie_word_embeddings`` says (a
    warning says so)."""

    def __init__(self, path: str | Path):
        self.path = _checkpoint_folder(Path(path))
        self.hf_config = read_json_object(self.path / CONFIG_FILE)
        config = config_from_hf(self.hf_config, name=f"{self.hf_config.get('model_type')} {self.path.name}")
        self.k3_layout = self.hf_config["model_type"] == "kimi_k3"
        self.fp8_block = None if self.k3_layout else fp8_block_size(self.hf_config)
        self.mxfp4 = self.k3_layout and mxfp4_group(self.hf_config) is not None
        self.files, self.stored_names = self._text_model(self._weight_files())
        self.config = self._untied_if_head_differs(config)

    def _text_model(self, files: dict[str, Path]) -> tuple[dict[str, Path], dict[str, str]]:
        """({tensor name: file}, {tensor name: the name stored}): a ``kimi_k3`` release's text model under
        ``model.*`` and ``lm_head`` whether stored so (a text-only export) or nested under ``language_model.`` (the
        multimodal release), its vision tower skipped with one printed line; other model types as stored."""
        if not self.k3_layout:
            return files, {name: name for name in files}
        vision = [name for name in files if name.startswith(VISION_PREFIXES)]
        if vision:
            print(f"{self.path}: skipping the vision tower's {len(vision)} tensors ({', '.join(VISION_PREFIXES)}); "
                  "the course runs the text model")
        names = {name.removeprefix(MULTIMODAL_PREFIX): name for name in set(files) - set(vision)}
        return {name: files[stored] for name, stored in names.items()}, names

    def _weight_files(self) -> dict[str, Path]:
        """{tensor name: the file that holds it}, from the index or the single file, each file's header read."""
        if (self.path / INDEX_FILE).is_file():
            weight_map = read_json_object(self.path / INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UnsupportedCheckpoint(f"{self.path / INDEX_FILE}: expected a weight_map {{tensor: file}}")
            files = {key: self.path / file for key, file in weight_map.items()}
        elif (self.path / SINGLE_FILE).is_file():
            files = dict.fromkeys(_tensor_names(self.path / SINGLE_FILE), self.path / SINGLE_FILE)
        elif any(self.path.glob("pytorch_model*.bin")):
            raise UnsupportedCheckpoint(f"path: {self.path} holds pytorch_model.bin (pickled weights) only; convert it "
                                        "to safetensors (transformers: load it and save_pretrained it again)")
        else:
            raise FileNotFoundError(f"path: {self.path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        for file in sorted(set(files.values())):
            absent = {key for key, held in files.items() if held == file} - set(_tensor_names(file))
            if absent:
                raise UnsupportedCheckpoint(f"{file}: {INDEX_FILE} places {len(absent)} tensors here that it does "
                                            f"not hold, e.g. {sorted(absent)[:2]}")
        return files

    def _untied_if_head_differs(self, cfg: K3Config) -> K3Config:
        """``cfg`` untied when it ties the head to the embedding but the folder stores a different lm_head."""
        if not cfg.tie_embeddings or HEAD not in self.files:
            return cfg
        if _same_tensor(self.files[EMBEDDING], self.stored_names[EMBEDDING], self.files[HEAD],
                        self.stored_names[HEAD]):
            return cfg
        warnings.warn(f"{self.path}: config.json sets tie_word_embeddings, but the stored {HEAD} differs from the "
                      "embedding: it is used as the head", stacklevel=3)
        return cfg.replace(tie_embeddings=False)

    def k3_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[dict[str, torch.Tensor]]:
        """:func:`k3_tensors` of this checkpoint (FP8 and MXFP4 weights dequantized to ``dtype``), each file
        memory-mapped once while the parts are read."""
        with ExitStack() as stack:
            handles = {file: stack.enter_context(safetensors.safe_open(file, framework="pt"))
                       for file in sorted(set(self.files.values()))}
            yield from k3_tensors(lambda key: handles[self.files[key]].get_tensor(self.stored_names[key]),
                                  self.files, self.config, self.fp8_block, dtype, self.mxfp4)


def _checkpoint_folder(path: Path) -> Path:
    """``path``, checked to be a folder holding a config.json (FileNotFoundError / NotADirectoryError naming it)."""
    if not path.exists():
        raise FileNotFoundError(f"path: {path} does not exist; expected a checkpoint folder (config.json + "
                                "safetensors)")
    if not path.is_dir():
        raise NotADirectoryError(f"path: {path} is a file; expected a checkpoint folder (config.json + safetensors)")
    if not any(path.iterdir()):
        raise FileNotFoundError(f"path: {path} is empty; expected a checkpoint folder (config.json + safetensors)")
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"path: {path} has no {CONFIG_FILE} (a transformers checkpoint folder)")
    return path


def read_json_object(file: Path) -> dict:
    """The JSON object in ``file``; ValueError naming the file when it is not JSON or holds no object."""
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file}: not JSON ({error})") from error
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object {{key: value}}, got a {type(value).__name__}")
    return value


def _tensor_names(file: Path) -> list[str]:
    """The tensor names in a safetensors file's header; FileNotFoundError or UnsupportedCheckpoint naming the file
    when it is missing or its header unreadable (a truncated download)."""
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing ({INDEX_FILE} lists it as a shard)")
    try:
        with safetensors.safe_open(file, framework="pt") as handle:
            return list(handle.keys())
    except safetensors.SafetensorError as error:
        raise UnsupportedCheckpoint(f"{file}: not a readable safetensors file ({error}); truncated? download it "
                                    "again") from error


def _same_tensor(file_a: Path, key_a: str, file_b: Path, key_b: str, rows: int = 4096) -> bool:
    """Whether two stored tensors are equal, compared ``rows`` rows at a time (the full pair never in memory)."""
    with safetensors.safe_open(file_a, framework="pt") as a, safetensors.safe_open(file_b, framework="pt") as b:
        slice_a, slice_b = a.get_slice(key_a), b.get_slice(key_b)
        if slice_a.get_shape() != slice_b.get_shape() or slice_a.get_dtype() != slice_b.get_dtype():
            return False
        return all(torch.equal(slice_a[start:start + rows], slice_b[start:start + rows])
                   for start in range(0, slice_a.get_shape()[0], rows))
