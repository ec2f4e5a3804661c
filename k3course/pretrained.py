"""Checkpoints in transformers' layout: Kimi Linear and DeepSeek-V3 (configs, names and shapes).

A checkpoint is a folder with ``config.json`` and safetensors weights: one ``model.safetensors``, or shards listed
by ``model.safetensors.index.json``. Two model types are read, each in both spellings of its keys:

    kimi_linear   Kimi-Linear-48B-A3B: KDA + NoPE MLA, sigmoid MoE with a shared expert
    deepseek_v3   DeepSeek-V3, Kimi K2 (``model_type`` "kimi_k2"), Moonlight: MLA with (YaRN) RoPE, grouped routing

released    the config.json keys and tensor names of the published checkpoints (Kimi Linear: ``linear_attn_config``
            with 1-indexed ``full_attn_layers``, ``num_experts``, per-expert ``w1 / w2 / w3``, ``q_conv1d``;
            DeepSeek: ``rope_scaling``, per-expert ``gate_proj / up_proj / down_proj``)
transformers  the names its config classes and modules use (``layer_types``, ``rope_parameters``; fused
            ``experts.gate_up_proj``, ``conv1d``, ``forget_gate.*``)

Multi-token-prediction layers (index ≥ ``num_hidden_layers``) are skipped. FP8 releases (DeepSeek-V3, Kimi K2:
e4m3 weights with a ``weight_scale_inv`` per 128 × 128 block, ``quantization_config``) are dequantized tensor by
tensor as they are read (:func:`dequantize_fp8`); every tensor's dtype is checked. What the course cannot express
(INT4 compressed-tensors weights, another routing function or activation, attention biases, another RoPE type) is
refused with :class:`UnsupportedCheckpoint` naming it. The way back (a :class:`K3Config`
that Kimi Linear can express, written in the released layout that transformers reads) is
:mod:`k3course.pretrained_save`.

This module knows :class:`~k3course.model.K3Model`'s parameter names as strings and never imports the model:
``K3Model.from_pretrained`` builds it on the meta device and assigns what :meth:`Checkpoint.k3_tensors` yields,
one layer at a time, read from memory-mapped files, so the weights are never in memory twice.

Per layer (H heads; KDA head dim K = V; MLA nope n, v widths, latent r; ᵀ: transposed, since K3's FFNs compute x W):

    input_layernorm / post_attention_layernorm      mixer_norm / ffn_norm
    KDA  q|k|v|b|o_proj                             mixer.q|k|v|b|o_proj
         q|k|v_conv1d [C, 1, W] (or conv1d [3C, 1, W])  mixer.q|k|v_conv [C, W]
         f_a_proj, f_b_proj, A_log [1, 1, H, 1], dt_bias [H·K]   mixer.f_proj.0|1, A_log [H], dt_bias [H, K]
         g_a_proj, g_b_proj, o_norm                 mixer.gate_proj.0|1, o_norm_weight
    MLA  q_proj or q_a_proj, q_a_layernorm, q_b_proj    mixer.q_up or q_down, q_norm, q_up
         kv_a_proj_with_mqa, kv_a_layernorm         mixer.kv_down, kv_norm
         kv_b_proj [H·(n + v), r]                   mixer.k_up [H, n, r], v_up [H, v, r] (split per head)
         o_proj                                     mixer.out
    FFN  mlp.gate|up|down_proj                      ffn.gate|up|down ᵀ
    MoE  gate.weight [E, d], gate.e_score_correction_bias     ffn.router [d, E] ᵀ, ffn.bias
         experts.j.w1|w3|w2 (gate_proj|up_proj|down_proj),   ffn.experts.gate_up [E, d, 2f] = [w1ᵀ | w3ᵀ],
         or experts.gate_up_proj [E, 2f, d], down_proj       ffn.experts.down [E, f, d] = w2ᵀ
         shared_experts.gate|up|down_proj            ffn.shared.gate|up|down ᵀ
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from k3course.config import K3Config

MODEL_TYPES = ("kimi_linear", "deepseek_v3", "kimi_k2")
# transformers' defaults for keys a config.json may leave out, where the two model types differ
DEFAULTS = {"kimi_linear": dict(n_group=1, topk_group=1, rms_norm_eps=1e-5, routed_scaling_factor=2.446),
            "deepseek_v3": dict(n_group=8, topk_group=4, rms_norm_eps=1e-6, routed_scaling_factor=2.5)}
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
CONFIG_FILE, SINGLE_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SCALE_SUFFIX = "_scale_inv"  # an FP8 release's block scales of tensor X.weight: X.weight_scale_inv
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
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
    """The :class:`K3Config` of a checkpoint's config.json (released or transformers keys). Dense layers first,
    PreNorm, SwiGLU, sigmoid routing with a bias trained by DeepSeek's sign rule, no output gate on MLA."""
    if not isinstance(hf, dict) or hf.get("model_type") not in MODEL_TYPES:
        found = hf.get("model_type") if isinstance(hf, dict) else type(hf).__name__
        raise UnsupportedCheckpoint(f"model_type: {found!r} is not one of {', '.join(MODEL_TYPES)}")
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
            isinstance(block, list | tuple) and len(block) == 2 and all(_is_positive_int(b) for b in block)):
        raise UnsupportedCheckpoint(f"quantization_config: expected fmt 'e4m3' and weight_block_size [rows, columns],"
                                    f" got fmt {quantization.get('fmt')!r}, weight_block_size {block!r}")
    return int(block[0]), int(block[1])


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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

    def read(self, key: str) -> torch.Tensor:
        """Tensor ``key``, checked: a floating dtype, or float8_e4m3fn dequantized with its ``_scale_inv``."""
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


class _Reader:
    """The tensors under one name prefix of a checkpoint (a :class:`_Source`)."""

    def __init__(self, source: _Source, prefix: str):
        self.source, self.prefix = source, prefix

    def has(self, name: str) -> bool:
        return self.prefix + name in self.source.keys

    def under(self, prefix: str) -> _Reader:
        return _Reader(self.source, self.prefix + prefix)

    def __call__(self, name: str) -> torch.Tensor:
        return self.source.read(self.prefix + name)

    def shaped(self, name: str, shape: tuple[int, ...], settings: str) -> torch.Tensor:
        """Tensor ``name`` reshaped to ``shape``, which config.json's ``settings`` (named in the error) imply."""
        tensor = self(name)
        if tensor.numel() != math.prod(shape):
            raise UnsupportedCheckpoint(f"checkpoint: tensor {self.prefix + name} has shape {tuple(tensor.shape)}, "
                                        f"but config.json's {settings} make it {shape}")
        return tensor.reshape(shape)


def k3_tensors(get: Callable[[str], torch.Tensor], keys, cfg: K3Config, fp8_block: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32) -> Iterator[dict[str, torch.Tensor]]:
    """{K3Model name: tensor} of a checkpoint's tensors ``get(key)`` (names ``keys``), one part at a time: the
    embedding, each decoder layer, the final norm and head; FP8 weights (blocks ``fp8_block``) dequantized to
    ``dtype`` as they are read. Raises UnsupportedCheckpoint naming a missing tensor or one of another dtype, or
    at the end the tensors nothing read (MTP layers, index ≥ n_layers, are skipped)."""
    keys, used = set(keys), set()
    read = _Reader(_Source(get, keys, used, fp8_block, dtype), "")
    yield {"embed.weight": read(EMBEDDING)}
    for i, (mixer, ffn) in enumerate(zip(cfg.layer_types(), cfg.ffn_types())):
        yield _layer_tensors(read.under(f"model.layers.{i}."), cfg, mixer, ffn, i)
    head = {"final_norm.weight": read("model.norm.weight")}
    if cfg.tie_embeddings:
        used.add(HEAD)  # a tied head may be stored too; Checkpoint unties a config whose stored head differs
    else:
        head["lm_head.weight"] = read(HEAD)
    yield head
    unread = sorted(k for k in keys - used if not _is_mtp(k, cfg.n_layers))
    if unread:
        raise UnsupportedCheckpoint(f"checkpoint: {len(unread)} tensors the course cannot place, e.g. {unread[:4]}")


def convert_state(tensors: dict[str, torch.Tensor], cfg: K3Config) -> dict[str, torch.Tensor]:
    """:func:`k3_tensors` of tensors in memory ({transformers name: tensor}), all at once."""
    return {name: t for part in k3_tensors(tensors.__getitem__, tensors.keys(), cfg) for name, t in part.items()}


def _is_mtp(key: str, n_layers: int) -> bool:
    match = LAYER_KEY.match(key)
    return match is not None and int(match.group(1)) >= n_layers


def _layer_tensors(read: _Reader, cfg: K3Config, mixer: str, ffn: str, i: int) -> dict[str, torch.Tensor]:
    """Layer i's tensors; its FFN under ``block_sparse_moe.`` (Kimi Linear's released MoE layers, and every FFN
    transformers writes for Kimi Linear) or ``mlp.``."""
    attention = read.under("self_attn.")
    mixer_tensors = _kda_tensors(attention, cfg) if mixer == "kda" else _mla_tensors(attention, cfg)
    moe_prefix = read.prefix + "block_sparse_moe."
    ffn_read = read.under("block_sparse_moe." if any(k.startswith(moe_prefix) for k in read.source.keys) else "mlp.")
    ffn_tensors = _dense_tensors(ffn_read) if ffn == "dense" else _moe_tensors(ffn_read, cfg)
    parts = {"mixer_norm.weight": read("input_layernorm.weight"),
             "ffn_norm.weight": read("post_attention_layernorm.weight"),
             **{f"mixer.{k}": t for k, t in mixer_tensors.items()}, **{f"ffn.{k}": t for k, t in ffn_tensors.items()}}
    return {f"layers.{i}.{name}": tensor for name, tensor in parts.items()}


def _kda_tensors(read: _Reader, cfg: K3Config) -> dict[str, torch.Tensor]:
    heads, width = cfg.kda_n_heads, cfg.kda_head_dim
    settings = f"linear num_heads {heads} and head_dim {width}"
    out = {f"{name}.weight": read(f"{name}.weight") for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj")}
    if read.has("conv1d.weight"):  # transformers: q, k, v convolutions stacked
        convs = read("conv1d.weight").squeeze(1).chunk(3)
    else:
        convs = [read(f"{x}_conv1d.weight").squeeze(1) for x in "qkv"]
    gate = read.under("forget_gate." if read.has("forget_gate.A_log") else "")
    out |= {"q_conv.weight": convs[0], "k_conv.weight": convs[1], "v_conv.weight": convs[2],
            "f_proj.0.weight": gate("f_a_proj.weight"), "f_proj.1.weight": gate("f_b_proj.weight"),
            "A_log": gate.shaped("A_log", (heads,), settings),
            "dt_bias": gate.shaped("dt_bias", (heads, width), settings),
            "gate_proj.0.weight": read("g_a_proj.weight"), "gate_proj.1.weight": read("g_b_proj.weight"),
            "o_norm_weight": read("o_norm.weight")}
    if cfg.kda_gate_bias:
        out["gate_proj.1.bias"] = read("g_b_proj.bias")
    return out


def _mla_tensors(read: _Reader, cfg: K3Config) -> dict[str, torch.Tensor]:
    if cfg.q_lora_rank is None:
        out = {"q_up.weight": read("q_proj.weight")}
    else:
        out = {"q_down.weight": read("q_a_proj.weight"), "q_norm.weight": read("q_a_layernorm.weight"),
               "q_up.weight": read("q_b_proj.weight")}
    settings = (f"num_attention_heads {cfg.mla_n_heads}, qk_nope_head_dim {cfg.qk_nope_head_dim}, v_head_dim "
                f"{cfg.v_head_dim} and kv_lora_rank {cfg.kv_lora_rank}")
    kv_up = read.shaped("kv_b_proj.weight",
                        (cfg.mla_n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank), settings)
    return out | {"kv_down.weight": read("kv_a_proj_with_mqa.weight"), "kv_norm.weight": read("kv_a_layernorm.weight"),
                  "k_up": kv_up[:, :cfg.qk_nope_head_dim], "v_up": kv_up[:, cfg.qk_nope_head_dim:],
                  "out.weight": read("o_proj.weight")}


def _dense_tensors(read: _Reader) -> dict[str, torch.Tensor]:
    return {name: read(f"{name}_proj.weight").T for name in ("gate", "up", "down")}


def _moe_tensors(read: _Reader, cfg: K3Config) -> dict[str, torch.Tensor]:
    out = {"router": read("gate.weight").T, "bias": read("gate.e_score_correction_bias")}
    if read.has("experts.gate_up_proj"):  # transformers: every expert in one tensor, gate rows before up rows
        out |= {"experts.gate_up": read("experts.gate_up_proj").transpose(1, 2),
                "experts.down": read("experts.down_proj").transpose(1, 2)}
    else:
        released_kimi = read.has("experts.0.w1.weight")
        gate, up, down = ("w1", "w3", "w2") if released_kimi else ("gate_proj", "up_proj", "down_proj")
        expert = lambda j, name: read(f"experts.{j}.{name}.weight").T
        out |= {"experts.gate_up": torch.stack([torch.cat([expert(j, gate), expert(j, up)], dim=1)
                                                for j in range(cfg.n_routed_experts)]),
                "experts.down": torch.stack([expert(j, down) for j in range(cfg.n_routed_experts)])}
    if cfg.n_shared_experts:
        out |= {f"shared.{k}": t for k, t in _dense_tensors(read.under("shared_experts.")).items()}
    else:
        _no_shared_experts(read.under("shared_experts."))
    return out


def _no_shared_experts(read: _Reader) -> None:
    """With ``n_shared_experts: 0`` transformers still writes the shared expert, with no rows: read it and check
    that it is empty (nothing to place)."""
    for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        if read.has(name) and read(name).numel():
            raise UnsupportedCheckpoint(f"checkpoint: tensor {read.prefix + name} is not empty, but config.json has "
                                        "n_shared_experts 0")


class Checkpoint:
    """A checkpoint folder: its :class:`K3Config` (``config``), the raw config.json (``hf_config``) and its tensors,
    read one at a time from memory-mapped safetensors files (:meth:`k3_tensors`). Checked on opening, before any
    weight is read: the folder, config.json, the index against its shards, every file's safetensors header, and
    the head: a stored ``lm_head`` that differs from the embedding is the head, whatever ``tie_word_embeddings``
    says (a warning says so)."""

    def __init__(self, path: str | Path):
        self.path = _checkpoint_folder(Path(path))
        self.hf_config = read_json_object(self.path / CONFIG_FILE)
        self.fp8_block = fp8_block_size(self.hf_config)
        config = config_from_hf(self.hf_config, name=f"{self.hf_config.get('model_type')} {self.path.name}")
        self.files = self._weight_files()
        self.config = self._untied_if_head_differs(config)

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
        if _same_tensor(self.files[EMBEDDING], EMBEDDING, self.files[HEAD], HEAD):
            return cfg
        warnings.warn(f"{self.path}: config.json sets tie_word_embeddings, but the stored {HEAD} differs from the "
                      "embedding: it is used as the head", stacklevel=3)
        return cfg.replace(tie_embeddings=False)

    def k3_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[dict[str, torch.Tensor]]:
        """:func:`k3_tensors` of this checkpoint (FP8 weights dequantized to ``dtype``), each file memory-mapped
        once while the parts are read."""
        with ExitStack() as stack:
            handles = {file: stack.enter_context(safetensors.safe_open(file, framework="pt"))
                       for file in sorted(set(self.files.values()))}
            yield from k3_tensors(lambda key: handles[self.files[key]].get_tensor(key), self.files, self.config,
                                  self.fp8_block, dtype)


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
