"""K3Model → a checkpoint folder (``K3Model.save_pretrained``), in one of two layouts:

kimi_linear  a :class:`~k3course.config.K3Config` that Kimi Linear can express, in the released layout that
             transformers reads; the names and shapes are the inverse of :mod:`k3course.pretrained`'s; a tied head
             is written as ``lm_head`` too, so any reader gets the same logits.
kimi_k3      the released K3 layout (``model_type`` ``kimi_k3``, nested ``text_config``, tensors under
             ``language_model.model.``), written from the table :func:`k3course.layout.checkpoint_layout` that
             :mod:`k3course.pretrained` reads with; routed experts in bf16, or MXFP4 on request.

The writers read their state tensor by tensor and convert one part at a time (a part: the rows of one layer, or
of the embeddings and head), so a state may be a :class:`LazyState`, whose item access gathers one tensor of a
sharded model (:func:`k3course.distributed.save_pretrained`): the writing process then holds at most one output
file's tensors and the part being converted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.tensor import DTensor

from k3course import layout
from k3course.config import K3Config
from k3course.guards import is_number
from k3course.pretrained import (
    CONFIG_FILE,
    HEAD,
    INDEX_FILE,
    K3_FIXED,
    K3_FIXED_KEYS,
    K3_FIXED_LINEAR_KEYS,
    K3_LINEAR_KEYS,
    K3_TEXT_KEYS,
    KIMI_LINEAR_FIXED,
    MULTIMODAL_PREFIX,
    MXFP4_FORMAT,
    SINGLE_FILE,
    UnsupportedCheckpoint,
)

LAYOUTS = ("kimi_linear", "kimi_k3")


class LazyState(Mapping):
    """A state dict read one tensor at a time: ``views`` {name: the tensor's global view, a DTensor or a tensor
    held whole}; item access returns the whole tensor (a DTensor's ``full_tensor()``, a collective: every rank
    reads the same names in the same order). ``keeps``: whether this process writes the folder; the others take
    part in the gathers and write nothing."""

    def __init__(self, views: dict[str, torch.Tensor], keeps: bool):
        self.views, self.keeps = views, keeps

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self.views[name]
        return view.full_tensor() if isinstance(view, DTensor) else view

    def __iter__(self) -> Iterator[str]:
        return iter(self.views)

    def __len__(self) -> int:
        return len(self.views)


def _described(state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """{name: a tensor of state[name]'s shape and dtype}, read without gathering (a LazyState's views)."""
    return state.views if isinstance(state, LazyState) else state


def _keeps(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether this process writes the folder of ``state`` (a LazyState: one rank of several)."""
    return not isinstance(state, LazyState) or state.keeps


def save(cfg: K3Config, state: Mapping[str, torch.Tensor], path: str | Path, layout: str = "kimi_linear",
         max_shard_bytes: int = 5 * 2**30, mxfp4: bool = False) -> Path:
    """Write ``state`` (a K3Model state dict, or a :class:`LazyState` of one) as a checkpoint folder in
    ``layout`` (:data:`LAYOUTS`: :func:`save_kimi_linear`, :func:`save_kimi_k3`). Returns the folder."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if mxfp4 and layout != "kimi_k3":
        raise ValueError("mxfp4: only the kimi_k3 layout stores routed experts in MXFP4")
    if layout == "kimi_k3":
        return save_kimi_k3(cfg, state, path, max_shard_bytes, mxfp4)
    return save_kimi_linear(cfg, state, path, max_shard_bytes)


def kimi_linear_config(cfg: K3Config, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json (transformers' keys) of a Kimi Linear model equal to ``cfg``; UnsupportedCheckpoint naming
    every field Kimi Linear cannot express (its layers are fixed: :data:`KIMI_LINEAR_FIXED`; one ε for the
    decoder norms and the KDA output norm; at least one shared expert)."""
    differ = [f"{key}={getattr(cfg, key)!r} (Kimi Linear: {value!r})" for key, value in KIMI_LINEAR_FIXED.items()
              if getattr(cfg, key) != value]
    if cfg.kda_norm_eps != cfg.norm_eps:
        differ.append(f"kda_norm_eps={cfg.kda_norm_eps} (Kimi Linear: norm_eps = {cfg.norm_eps}, both rms_norm_eps)")
    if cfg.n_shared_experts < 1:
        differ.append("n_shared_experts=0 (Kimi Linear: at least 1)")
    if differ:
        raise UnsupportedCheckpoint(f"cfg: Kimi Linear cannot express {'; '.join(differ)}")
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "dtype": str(dtype).removeprefix("torch."), "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "intermediate_size": cfg.dense_ffn_dim,
        "moe_intermediate_size": cfg.expert_dim, "num_attention_heads": cfg.mla_n_heads,
        "num_key_value_heads": cfg.mla_n_heads, "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "linear_num_heads": cfg.kda_n_heads, "linear_head_dim": cfg.kda_head_dim,
        "linear_conv_kernel_dim": cfg.kda_conv_size, "num_experts": cfg.n_routed_experts,
        "num_experts_per_token": cfg.top_k, "num_shared_experts": cfg.n_shared_experts,
        "num_expert_group": cfg.n_expert_groups, "topk_group": cfg.topk_groups,
        "moe_renormalize": cfg.renormalize_top_k, "routed_scaling_factor": cfg.route_scale,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "pad_token_id": cfg.pad_token_id,
        "bos_token_id": None, "eos_token_id": None, "hidden_act": "silu", "model_max_length": cfg.context_length,
        "layer_types": ["full_attention" if kind == "mla" else "linear_attention" for kind in cfg.layer_types()],
        "mlp_layer_types": ["dense" if kind == "dense" else "sparse" for kind in cfg.ffn_types()],
    }


def save_kimi_linear(cfg: K3Config, state: Mapping[str, torch.Tensor], path: str | Path,
                     max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``state`` (a K3Model state dict) as a Kimi Linear checkpoint folder: config.json and safetensors in
    the released names (:func:`k3course.layout.checkpoint_layout`), sharded at part boundaries (at most
    ``max_shard_bytes`` a shard unless one part is larger) with an index when there is more than one shard. A tied
    head is written as ``lm_head`` too, a copy of the embedding (safetensors stores no shared tensors):
    transformers' Kimi Linear then has the right head whether or not it ties it, and
    :class:`~k3course.pretrained.PretrainedFolder` reads the pair back as tied. Converts one part at a time. Returns the
    folder."""
    config = kimi_linear_config(cfg, _described(state)["embed.weight"].dtype)
    parts = layout.checkpoint_layout(cfg)

    def stored(part: list[layout.Row]) -> dict[str, torch.Tensor]:
        out = {name: t.contiguous() for row in part for name, t in row.write(state, cfg).items()}
        if cfg.tie_embeddings and part is parts[-1]:
            out[HEAD] = state["embed.weight"].clone()
        return out
    return _write_folder(config, [lambda part=part: stored(part) for part in parts], _sizes(parts, state), path,
                         max_shard_bytes, _keeps(state))


def _sizes(parts: list[list[layout.Row]], state: Mapping[str, torch.Tensor],
           dtype: torch.dtype | None = None) -> list[int]:
    """The bytes of each part's tensors (in ``dtype``, or their own), read without gathering."""
    described = _described(state)
    return [sum(described[name].numel() * (dtype or described[name].dtype).itemsize for row in part
                for name in row.ours) for part in parts]


def kimi_k3_config(cfg: K3Config, dtype: torch.dtype = torch.bfloat16, mxfp4: bool = False) -> dict:
    """The config.json of the released K3 layout for ``cfg``: ``model_type`` ``kimi_k3`` with the text model's
    settings nested in ``text_config`` (the tables of :mod:`k3course.pretrained`, read back by
    :func:`~k3course.pretrained.k3_config_from_hf`) and, with ``mxfp4``, the release's compressed-tensors
    ``quantization_config`` (routed experts only). UnsupportedCheckpoint names every field the layout cannot
    express (K3's layers are fixed: :data:`~k3course.pretrained.K3_FIXED`)."""
    differ = [f"{key}={getattr(cfg, key)!r} (the K3 layout: {value!r})" for key, value in K3_FIXED.items()
              if getattr(cfg, key) != value]
    for field, why in (("kda_norm_eps", cfg.kda_norm_eps != cfg.norm_eps), ("latent_dim", cfg.latent_dim is None),
                       ("q_lora_rank", cfg.q_lora_rank is None), ("n_shared_experts", cfg.n_shared_experts < 1),
                       ("attnres_block_size", cfg.attnres_block_size % 2)):
        if why:
            differ.append(f"{field}={getattr(cfg, field)!r} (the K3 layout: {_K3_NEEDS[field]})")
    if differ:
        raise UnsupportedCheckpoint(f"cfg: the K3 layout cannot express {'; '.join(differ)}")
    mla = [i + 1 for i, kind in enumerate(cfg.layer_types()) if kind == "mla"]
    text = {key: getattr(cfg, field) for key, field in K3_TEXT_KEYS.items()} | K3_FIXED_KEYS | {
        "model_type": "kimi_linear", "num_key_value_heads": cfg.mla_n_heads,
        "attn_res_block_size": cfg.attnres_block_size // 2, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": cfg.rope_theta},
        "linear_attn_config": {key: getattr(cfg, field) for key, field in K3_LINEAR_KEYS.items()}
        | K3_FIXED_LINEAR_KEYS | {"full_attn_layers": mla,
                                 "kda_layers": [i for i in range(1, cfg.n_layers + 1) if i not in mla]}}
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
              "dtype": str(dtype).removeprefix("torch."), "text_config": text}
    if mxfp4:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": MXFP4_FORMAT,
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": layout.MXFP4_GROUP,
                                                      "strategy": "group", "symmetric": True},
                                          "input_activations": None, "targets": ["Linear"]}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.*", "re:.*routed_expert_.*",
                       "re:.*block_sparse_moe.gate$", "lm_head", "re:vision_tower.*"]}
    return config


_K3_NEEDS = {"kda_norm_eps": "equal to norm_eps, both rms_norm_eps", "latent_dim": "a latent MoE",
             "q_lora_rank": "a query rank", "n_shared_experts": "at least 1",
             "attnres_block_size": "even: whole decoder layers"}


def save_kimi_k3(cfg: K3Config, state: Mapping[str, torch.Tensor], path: str | Path, max_shard_bytes: int = 5 * 2**30,
                 mxfp4: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``state`` (a K3Model state dict) in the released K3 layout: config.json (:func:`kimi_k3_config`) and
    safetensors under ``language_model.``, weights in ``dtype`` (bf16, as released; the MoE selection biases in
    fp32), routed experts packed to MXFP4 (:func:`k3course.layout.pack_mxfp4`) with ``mxfp4``; sharded at part
    boundaries as :func:`save_kimi_linear`. Converts one part at a time. Returns the folder."""
    config = kimi_k3_config(cfg, dtype, mxfp4)
    parts = layout.checkpoint_layout(cfg)
    return _write_folder(config, [lambda part=part: _k3_stored(part, state, cfg, mxfp4, dtype) for part in parts],
                         _sizes(parts, state, dtype), path, max_shard_bytes, _keeps(state))


def _k3_stored(part: list[layout.Row], state: Mapping[str, torch.Tensor], cfg: K3Config, mxfp4: bool,
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One part of the K3 layout under its released names: each row written, in ``dtype`` (the MoE biases fp32),
    routed experts as ``weight_packed`` + ``weight_scale`` with ``mxfp4``."""
    out = {}
    for row in part:
        for name, tensor in row.write(state, cfg).items():
            name = MULTIMODAL_PREFIX + name
            if mxfp4 and layout.is_routed_expert(name):
                out[name + "_packed"], out[name + "_scale"] = layout.pack_mxfp4(tensor.contiguous())
            else:
                out[name] = tensor.float() if name.endswith("e_score_correction_bias") else tensor.to(dtype)
                out[name] = out[name].contiguous()
    return out


def _write_folder(config: dict, parts: list, sizes: list[int], path: str | Path, max_shard_bytes: int,
                  keeps: bool = True) -> Path:
    """config.json and the tensors of ``parts`` (callables, each giving {name: tensor}; ``sizes`` their bytes)
    in safetensors files, sharded greedily at part boundaries, with an index when there is more than one. One
    file's tensors are held at a time. ``keeps`` False: every part is made (the gathers of a LazyState, which
    every rank joins) and nothing is written."""
    if not is_number(max_shard_bytes) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    path = Path(path)
    if keeps:
        path.mkdir(parents=True, exist_ok=True)
    shards = _shard_plan(sizes, max_shard_bytes)
    weight_map = {}
    for number, members in enumerate(shards, 1):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        weight_map |= dict.fromkeys(_write_file([parts[index] for index in members], path / file, keeps), file)
    if not keeps:
        return path
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=1))
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return path


def _write_file(parts: list, file: Path, keeps: bool) -> list[str]:
    """The tensors of ``parts`` (made in turn) saved in one safetensors ``file`` (``keeps`` False: made only);
    returns their names. They are let go on return, before the next file's are made."""
    tensors = {name: t.detach().cpu() for part in parts for name, t in part().items()}
    if keeps:
        safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
    return list(tensors)


def _shard_plan(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Consecutive parts grouped greedily into shards of at most max_shard_bytes (a larger part alone)."""
    shards, used = [[]], 0
    for index, size in enumerate(sizes):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(index)
        used += size
    return shards
