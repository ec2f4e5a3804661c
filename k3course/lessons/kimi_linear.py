"""Lesson 15: your K3Model runs Kimi Linear (and DeepSeek-V3) checkpoints that transformers wrote.

The one lesson that uses transformers (the ``oracle`` extra, imported inside the functions that need it):

    tiny_kimi_linear, tiny_deepseek_v3   a tiny random model built and saved by transformers (with a character
                                         tokenizer saved beside it), returned with its folder
    tiny_k3, with_mxfp4_experts          a tiny random K3Model saved in the released K3 layout (bf16, or MXFP4
                                         routed experts), and the model those MXFP4 experts dequantize to
    beside_the_release                   a K3 folder's text_config next to the released K3's, key by key
    relative_error                       max |ours − theirs| / max |theirs|
    cached_decode_logits                 transformers' logits from a prefill, then one token at a time through its cache
    decode_needs                         what a preset needs to decode: bf16 weights, FLOPs and weight bytes per token

A checkpoint's own tokenizer and ``k3course generate --pretrained PATH`` are core features:
:mod:`k3course.pretrained_generation`.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from k3course import accounting, layout
from k3course.config import K3Config
from k3course.model import K3Model
from k3course.pretrained import read_json_object
from k3course.pretrained_generation import import_transformers
from k3course.pretrained_save import kimi_k3_config

# A tiny model's sizes, in transformers' config keys (shared by both model types)
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=2,
            num_key_value_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# the tiny tokenizer's characters, after the three special tokens: one token each (61 + 3 = 64 = vocab_size)
CHARACTERS = " etaoinshrdlcumwfgypbvkjxqz.,;:!?'\"-()\nETAOINSHRDLCUMWFGYPBVKJ"
SPECIALS = ("<pad>", "<s>", "</s>")
# transformers' KDA and short-convolution functions, which it binds to fla's Triton kernels when fla is installed
KDA_OPS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update")


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours − theirs| / max |theirs|, in float64."""
    return float((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max())


@contextmanager
def torch_kda_paths():
    """Inside the block transformers' Kimi Linear runs its PyTorch KDA and convolution on a CPU (the Triton
    kernels of fla, which it binds when fla is installed, need a GPU), without logging that it falls back to them;
    on a GPU it changes nothing."""
    modeling = import_transformers().models.kimi_linear.modeling_kimi_linear
    bound = {name: getattr(modeling, name) for name in KDA_OPS if hasattr(modeling, name)}
    kernels_log = logging.getLogger("transformers.integrations.hub_kernels")
    level = kernels_log.level
    try:
        if not torch.cuda.is_available():
            for name, function in bound.items():
                setattr(modeling, name, inspect.unwrap(function))
            kernels_log.setLevel(logging.ERROR)  # "falling back to its reference PyTorch implementation" is the point
        yield
    finally:
        for name, function in bound.items():
            setattr(modeling, name, function)
        kernels_log.setLevel(level)


@torch.no_grad()
def cached_decode_logits(reference: torch.nn.Module, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """transformers' logits for ``ids`` (batch, T) made the way a server decodes: one forward over the first
    ``prompt`` tokens (logits (batch, prompt, vocab)), then one forward per later token t, each handed the cache
    the previous call returned (logits (batch, 1, vocab)); concatenated along time: (batch, T, vocab).

    The cache goes in and comes out under the name the installed transformers takes: ``cache`` where its forward
    has that argument (5.25 has it and deprecates ``past_key_values``), ``past_key_values`` where it has not (5.23)."""
    if not 1 <= prompt <= ids.shape[1]:
        raise ValueError(f"prompt must be between 1 and the sequence length {ids.shape[1]}, got {prompt}")
    name = "cache" if "cache" in inspect.signature(reference.forward).parameters else "past_key_values"
    out = reference(ids[:, :prompt], use_cache=True)
    logits = [out.logits]
    for t in range(prompt, ids.shape[1]):
        out = reference(ids[:, t:t + 1], use_cache=True, **{name: getattr(out, name)})
        logits.append(out.logits)
    return torch.cat(logits, 1)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from transformers' N(0, 0.02²) start, which leaves every signal tiny: matrices N(0, 1/fan_in),
    norm gains 1 ± 0.2, MoE selection biases N(0, 0.05²); KDA's A_log and dt_bias keep their initialisation.
    A wrong weight map or ε then shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            continue
        noise = torch.randn(param.shape, generator=generator)
        param.copy_(noise / param.shape[-1] ** 0.5 if param.dim() > 1 else 1 + 0.2 * noise)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))


def char_tokenizer():
    """A transformers tokenizer with one token per character of :data:`CHARACTERS` (ids 3…63) and the special
    tokens <pad> <s> </s> (0, 1, 2); characters outside the set are dropped."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    PreTrainedTokenizerFast = import_transformers().PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIALS, *CHARACTERS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def _saved(model: torch.nn.Module, path: Path | str, seed: int, **save_options) -> tuple[torch.nn.Module, Path]:
    import_transformers().utils.logging.disable_progress_bar()  # no "Writing model shards" bar in the lesson's output
    randomize(model, seed)
    path = Path(path)
    model.save_pretrained(path, **save_options)
    char_tokenizer().save_pretrained(path)
    return model.eval(), path


def tiny_kimi_linear(path: Path | str, seed: int = 0) -> tuple[torch.nn.Module, Path]:
    """A 4-layer Kimi Linear (KDA, NoPE MLA, KDA, NoPE MLA; a dense first FFN, then 8-expert sigmoid MoE with a
    shared expert) built by transformers with seeded random weights, saved in ``path`` in shards of 40 KiB with
    an index, with :func:`char_tokenizer`. Returns (transformers' model in eval mode, path)."""
    hf = import_transformers()
    config = hf.KimiLinearConfig(**TINY | dict(
        num_hidden_layers=4, num_local_experts=8, linear_num_heads=2, linear_head_dim=8, n_group=1, topk_group=1,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]))
    torch.manual_seed(seed)
    return _saved(hf.KimiLinearForCausalLM(config), path, seed + 1, max_shard_size="40KB")


def tiny_deepseek_v3(path: Path | str, seed: int = 0) -> tuple[torch.nn.Module, Path]:
    """A 3-layer DeepSeek-V3 (MLA with YaRN RoPE: factor 4 over 16 original positions, mscale_all_dim 0.8; a
    dense first FFN, then 8 experts in 4 groups keeping 2), built and saved by transformers with seeded random
    weights and :func:`char_tokenizer`. Returns (transformers' model in eval mode, path)."""
    hf = import_transformers()
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
                beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)
    config = hf.DeepseekV3Config(**TINY | dict(
        num_hidden_layers=3, q_lora_rank=16, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=64, rope_parameters=yarn))
    torch.manual_seed(seed)
    return _saved(hf.DeepseekV3ForCausalLM(config), path, seed + 1)


# The tiny preset as the released K3 layout stores it: ε 1e-5 in every norm, learned AttnRes key-norm weights
TINY_K3 = K3Config.preset("tiny").replace(name="tiny-k3", norm_eps=1e-5, kda_norm_eps=1e-5, attnres_key_weight=True)


@torch.no_grad()
def tiny_k3(path: Path | str, seed: int = 0, mxfp4: bool = False, cfg: K3Config = TINY_K3) -> tuple[K3Model, Path]:
    """A tiny K3Model (``cfg``) with seeded random weights far from their start (:func:`randomize`; MoE selection
    biases N(0, 0.05²)) rounded to bf16, saved in ``path`` in the released K3 layout (``save_pretrained(layout=
    "kimi_k3")``: bf16, or routed experts in MXFP4 with ``mxfp4``). Returns (the model in eval mode, path): the
    bf16 folder holds exactly its weights."""
    torch.manual_seed(seed)
    model = K3Model.from_config(cfg)
    randomize(model, seed + 1)
    generator = torch.Generator().manual_seed(seed + 2)
    for moe in model.moe_layers():
        moe.bias.copy_(0.05 * torch.randn(moe.bias.shape, generator=generator))
    for param in model.parameters():
        param.copy_(param.bfloat16())
    model.save_pretrained(path, layout="kimi_k3", mxfp4=mxfp4)
    return model.eval(), Path(path)


@torch.no_grad()
def with_mxfp4_experts(model: K3Model) -> K3Model:
    """``model`` with every routed expert's weights replaced by what their MXFP4 form dequantizes to
    (:func:`~k3course.layout.pack_mxfp4` then :func:`~k3course.layout.unpack_mxfp4`, each stored matrix
    [out, in] grouped along ``in``, as the release stores them); the model is changed in place and returned."""
    for moe in model.moe_layers():
        for weight in (moe.experts.gate_up, moe.experts.down):  # [E, in, out]: stored transposed, [E, out, in]
            stored = weight.transpose(1, 2)
            if weight is moe.experts.gate_up:  # w1 and w3 are two stored matrices of f rows each
                halves = stored.chunk(2, dim=1)
                stored = torch.cat([layout.unpack_mxfp4(*layout.pack_mxfp4(half)) for half in halves], dim=1)
            else:
                stored = layout.unpack_mxfp4(*layout.pack_mxfp4(stored))
            weight.copy_(stored.transpose(1, 2))
    return model


def beside_the_release(path: Path | str) -> list[tuple[str, object, object]]:
    """(key, the folder's value, the released K3's value) for every key of the text_config of a ``kimi_k3``
    folder, nested linear_attn_config keys as ``linear_attn_config.KEY``; the released values are the
    ``kimi-k3`` preset's, written by the same table (:func:`~k3course.pretrained_save.kimi_k3_config`)."""
    ours = _flat(read_json_object(Path(path) / "config.json")["text_config"])
    released = _flat(kimi_k3_config(K3Config.preset("kimi-k3"))["text_config"])
    return [(key, ours.get(key), released.get(key)) for key in {**ours, **released}]


def _flat(settings: dict, prefix: str = "") -> dict:
    """A nested dict's leaves as {"outer.inner": value}."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat


@dataclass(frozen=True)
class DecodeNeeds:
    """What decoding one token needs: ``weight_bytes`` (all weights stored), ``flops_per_token`` and
    ``read_bytes_per_token`` (the active weights one decode step of one sequence reads: the embedding's one row)."""

    weight_bytes: int
    flops_per_token: int
    read_bytes_per_token: int


def decode_needs(cfg: K3Config, dtype_bytes: int = 2, context: int = 0) -> DecodeNeeds:
    """For a preset, in ``dtype_bytes``-byte weights (bf16: 2):

        weight_bytes          = total parameters · dtype_bytes
        flops_per_token       = accounting.decode_flops_per_token(cfg, context)   (2 per active weight + attention)
        read_bytes_per_token  = accounting.decode_weight_params(cfg, 1) · dtype_bytes   (the course's one
                                convention, lesson 14's: a lookup reads its row; a tied head reads the table)
    """
    read = accounting.decode_weight_params(cfg, 1) * dtype_bytes
    return DecodeNeeds(accounting.param_count(cfg).total * dtype_bytes, accounting.decode_flops_per_token(cfg, context),
                       int(read))
