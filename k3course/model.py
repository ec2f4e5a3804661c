"""The assembled K3: ``K3Model.from_config(cfg)`` builds exactly the decoder a :class:`K3Config` describes.

    h_0 = Embed(tokens)                                                          [B, T, d]
    for layer i in 0 … L−1 (two sub-layers each, read and written through the residual scheme):
        a_i = Mixer_i(RMSNorm(read()))       Mixer_i = KDA or gated MLA      (cfg.layer_types())
        f_i = FFN_i(RMSNorm(read()))         FFN_i   = dense GLU or latent MoE (cfg.ffn_types())
    logits = LMHead(RMSNorm(final()))                                            [B, T, vocab]

``read()`` is PreNorm's running sum (``residual="prenorm"``) or Block AttnRes's depth attention over the
embedding and the block sums (``residual="block_attnres"``, one pseudo-query per sub-layer and one for the final
aggregation). Depth attention mixes the sub-layer outputs of the same token, so decoding needs no cache for it:
the model's cache is one entry per layer, the KDA state + conv tails or the MLA latent cache
(:class:`K3Cache`, from :meth:`K3Model.new_cache`).

``forward(tokens, cache=None, targets=None) -> (logits, loss, cache)``: with a cache the tokens continue the
cached sequences; with targets the loss is the mean next-token cross-entropy (``IGNORE`` = −100 positions
skipped) plus, in training, the MoE layers' auxiliary losses (Switch aux loss when balancing is "aux_loss",
router z-loss weighted by ``cfg.z_loss_weight``).

Checkpoints in the ecosystem's format: :meth:`K3Model.from_pretrained` runs transformers-layout Kimi Linear and
DeepSeek-V3 checkpoints, :meth:`K3Model.save_pretrained` writes a Kimi Linear one (the names and configs live in
:mod:`k3course.pretrained`, a floor below, which knows this module's parameter names as strings).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from k3course import pretrained, pretrained_save
from k3course.config import K3Config
from k3course.guards import is_number
from k3course.layers.kda import KDACache, KimiDeltaAttention
from k3course.layers.mla import GatedMLA, MLACache
from k3course.layers.residual import block_attnres_read, make_residual
from k3course.moe.experts import GLUFFN
from k3course.moe.layers import MoE
from k3course.params import carry_marks, is_decayed, is_residual_output, no_weight_decay, param_groups

IGNORE = -100  # targets at positions without a label (torch's cross-entropy ignore_index)
INIT_STD = 0.02  # N(0, 0.02²) for projections and the embedding; output projections get 0.02 / √(2L)


@dataclass
class K3Cache:
    """The decoding cache of a whole model: ``layers[i]`` is layer i's :class:`KDACache` or :class:`MLACache`."""

    layers: list[KDACache | MLACache]

    @property
    def length(self) -> int:
        """Tokens cached so far (the same in every layer)."""
        return self.layers[0].length

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    def nbytes(self) -> int:
        """Bytes held for decoding: every KDA state and conv tail, and the filled part of every MLA cache."""
        return sum(layer.nbytes() for layer in self.layers)


class DecoderLayer(nn.Module):
    """One K3 decoder layer: a token mixer (KDA or gated MLA) and an FFN (dense GLU or MoE), each behind an
    RMSNorm; the residual scheme decides what each reads (see the module docstring)."""

    def __init__(self, cfg: K3Config, index: int, kernels: str | None = None):
        super().__init__()
        self.mixer_kind, self.ffn_kind = cfg.layer_types()[index], cfg.ffn_types()[index]
        self.mixer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = (KimiDeltaAttention.from_config(cfg, kernels=kernels) if self.mixer_kind == "kda"
                      else GatedMLA.from_config(cfg, kernels=kernels))
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        for norm in (self.mixer_norm, self.ffn_norm):
            no_weight_decay(norm.weight)
        self.ffn = (GLUFFN(cfg.d_model, cfg.dense_ffn_dim, cfg.ffn_activation) if self.ffn_kind == "dense"
                    else MoE.from_config(cfg, kernels=kernels))

    def forward(self, stream, cache: KDACache | MLACache | None):
        """Read, mix, write; read, FFN, write. Returns the layer's (updated) cache."""
        mixed, cache = self.mixer(self.mixer_norm(stream.read()), cache)
        stream.write(mixed)
        stream.write(self.ffn(self.ffn_norm(stream.read())))
        return cache


class K3Model(nn.Module):
    """The K3 decoder of a :class:`K3Config`, built only from the package's layers (see the module docstring)."""

    def __init__(self, cfg: K3Config, kernels: str | None = None):
        super().__init__()
        if not isinstance(cfg, K3Config):
            raise TypeError(f"cfg must be a K3Config (e.g. K3Config.preset('tiny')), got {type(cfg).__name__}")
        from k3course.kernels import kernel_backend

        self.cfg, self.kernels = cfg, kernel_backend(kernels)  # the one kernel choice, read by every layer
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.kernels) for i in range(cfg.n_layers))
        block_size = cfg.attnres_block_size if cfg.residual == "block_attnres" else None
        self.residual = make_residual(cfg.residual, 2 * cfg.n_layers, cfg.d_model, block_size, cfg.norm_eps,
                                      cfg.attnres_key_weight, self.kernels)
        self.final_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        no_weight_decay(self.final_norm.weight)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.init_weights()

    @classmethod
    def from_config(cls, cfg: K3Config, device: torch.device | str | None = None,
                    kernels: str | None = None) -> K3Model:
        """Build on ``device`` (``"meta"``: shapes only, no memory, seconds even for the full K3) with the kernel
        backend ``kernels`` (:data:`k3course.kernels.BACKENDS`; None: the environment variable
        ``K3COURSE_KERNELS``, default "auto"): chosen once here, read by every KDA layer, expert bank and residual
        read."""
        with torch.device(device or "cpu"):
            return cls(cfg, kernels)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str | None = None,
                        dtype: torch.dtype = torch.float32) -> K3Model:
        """The model of a transformers-layout checkpoint folder (config.json + safetensors, sharded or not) of a
        ``kimi_linear`` or ``deepseek_v3`` model (:mod:`k3course.pretrained` says what is read and refused).

        Built on the meta device, then filled one layer at a time with tensors read from the memory-mapped files
        and converted to this model's layout, so the weights are never held twice; an FP8 release's block-scaled
        e4m3 weights are dequantized to ``dtype`` as they are read. Every tensor's dtype is checked (floating, or
        FP8 with its scales); the head is untied when the folder stores one that differs from the embedding.
        Parameters in ``dtype`` on ``device``; the MoE selection biases stay fp32. Returned in eval mode.
        """
        return cls.from_checkpoint(pretrained.PretrainedFolder(path), device, dtype)

    @classmethod
    def from_checkpoint(cls, checkpoint: pretrained.PretrainedFolder, device: torch.device | str | None = None,
                        dtype: torch.dtype = torch.float32) -> K3Model:
        """:meth:`from_pretrained` of a folder already opened (and checked) as a
        :class:`~k3course.pretrained.PretrainedFolder`: its headers and its head are not read a second time."""
        model = cls.from_config(checkpoint.config, device="meta")
        device = torch.device(device or "cpu")
        for part in checkpoint.k3_tensors(dtype):
            for name, tensor in part.items():
                model._assign(name, tensor, device, dtype)
        model._materialize(device)
        return model.eval()

    def save_pretrained(self, path: str | Path, max_shard_bytes: int = 5 * 2**30, layout: str = "kimi_linear",
                        mxfp4: bool = False) -> Path:
        """Write this model as a checkpoint folder (config.json + safetensors, sharded above ``max_shard_bytes``)
        in ``layout``: "kimi_linear" (what transformers' Kimi Linear opens; UnsupportedCheckpoint names each
        setting Kimi Linear cannot express: Block AttnRes, SiTU-GLU, K3's full-rank or biased gates, the bounded
        KDA gate, latent MoE, RoPE ...) or "kimi_k3" (the released K3 layout in bf16, routed experts in MXFP4 with
        ``mxfp4``; UnsupportedCheckpoint names what it cannot express). A model sharded over ranks
        (:meth:`is_sharded`) is written by :func:`k3course.distributed.save_pretrained`, which every rank calls;
        here it is refused."""
        if self.is_sharded():
            raise ValueError("save_pretrained: this model is sharded over ranks (FSDP2 DTensor weights or expert "
                             "parallelism); every rank calls k3course.distributed.save_pretrained(model, path, mesh) "
                             "instead, which gathers it one tensor at a time")
        return pretrained_save.save(self.cfg, self.state_dict(), path, layout, max_shard_bytes, mxfp4)

    def is_sharded(self) -> bool:
        """Whether this process holds only part of the model: FSDP2 shards (DTensor weights) or a block of some
        MoE layer's routed experts (expert parallelism)."""
        return (any(isinstance(param, DTensor) for param in self.parameters())
                or any(moe.experts.gate_up.shape[0] < moe.n_routed_experts for moe in self.moe_layers()))

    @torch.no_grad()
    def _assign(self, name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        """Put a copy of ``tensor`` in place of parameter or buffer ``name`` (marks kept). Parameters take
        ``dtype``; buffers keep their precision if wider (the fp32 MoE bias)."""
        module_name, _, leaf = name.rpartition(".")
        module = self.get_submodule(module_name)
        old = getattr(module, leaf)
        if tuple(tensor.shape) != tuple(old.shape):
            raise ValueError(f"{name}: the checkpoint holds shape {tuple(tensor.shape)}, the model {tuple(old.shape)}")
        is_parameter = isinstance(old, nn.Parameter)
        # a contiguous copy: never a view of the file, and converted tensors are often transposes
        copy = tensor.to(device, dtype if is_parameter else torch.promote_types(old.dtype, dtype), copy=True,
                         memory_format=torch.contiguous_format)
        setattr(module, leaf, carry_marks(old, nn.Parameter(copy, old.requires_grad)) if is_parameter else copy)

    def _materialize(self, device: torch.device) -> None:
        """After assigning a checkpoint: fail naming any weight it did not fill, and make the state no checkpoint
        holds (the MoE routing records and losses) zeros on ``device``."""
        missing = [name for name, tensor in self.state_dict().items() if tensor.is_meta]
        if missing:
            raise ValueError(f"checkpoint: no tensor for {len(missing)} weights, e.g. {missing[:4]}")
        for module in self.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_meta:
                    setattr(module, name, torch.zeros_like(buffer, device=device))
        for moe in self.moe_layers():
            moe.aux_loss, moe.z_loss = torch.zeros((), device=device), torch.zeros((), device=device)

    # --- initialisation and optimisation ------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """By the marks the layers set (:mod:`k3course.params`): N(0, 0.02²) for every projection and the
        embedding; residual outputs (the last map of every sub-layer, which writes into the residual stream)
        N(0, (0.02 / √(2L))²), as in GPT-2; parameters marked no_weight_decay (gates' rates and biases,
        convolutions, norms, AttnRes queries) keep the values their layers start from."""
        if self.embed.weight.is_meta:
            return
        out_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for param in self.parameters():
            if is_residual_output(param):
                param.normal_(0.0, out_std)
            elif is_decayed(param):
                param.normal_(0.0, INIT_STD)

    def param_groups(self, weight_decay: float, gate_lr_scale: float = 1.0, lr: float | None = None) -> list[dict]:
        """AdamW groups by the layers' marks (:func:`k3course.params.param_groups`): weight decay on the
        projections, none on the parameters marked no_weight_decay (norms, biases, gate rates and biases,
        convolution taps, AttnRes queries); the forget gates' parameters at ``gate_lr_scale`` × the rate (each
        group's "lr" set when ``lr`` is given)."""
        return param_groups(self.parameters(), weight_decay, gate_lr_scale, lr)

    def moe_layers(self) -> list[MoE]:
        """The MoE modules, in layer order (for the bias update and routing statistics)."""
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoE)]

    def param_breakdown(self) -> dict[str, tuple[int, int]]:
        """{component: (total, active per token)} counted from the module tree (the names of
        ``accounting.param_count(K3Config).components``). A token uses top_k of each MoE layer's routed experts."""
        parts = dict.fromkeys(("embedding", "lm_head", "kda_attention", "mla_attention", "dense_ffn",
                               "shared_experts", "latent_projections", "router", "norms_and_residual",
                               "routed_experts"), (0, 0))
        for name, param in self.named_parameters():
            component, active = _component_of(self, name, param.numel())
            total_so_far, active_so_far = parts[component]
            parts[component] = (total_so_far + param.numel(), active_so_far + active)
        return parts

    # --- the forward pass ---------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> K3Cache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens (MLA caches grow if exceeded)."""
        return K3Cache([layer.mixer.new_cache(batch, max_len, device, dtype) for layer in self.layers])

    def forward(self, tokens: torch.Tensor, cache: K3Cache | None = None, targets: torch.Tensor | None = None):
        """tokens [B, T] int -> (logits [B, T, vocab], loss or None, cache).

        The returned cache holds these tokens after the cached ones (a given cache is updated in place)."""
        self._check_inputs(tokens, cache, targets)
        stream = self.residual.begin(self.embed(tokens))
        layer_caches = [None] * len(self.layers) if cache is None else cache.layers
        new_caches = [layer(stream, layer_cache) for layer, layer_cache in zip(self.layers, layer_caches)]
        hidden = self.final_norm(stream.final())
        logits = hidden @ self.embed.weight.T if self.lm_head is None else self.lm_head(hidden)
        loss = None if targets is None else self.loss(logits, targets)
        if cache is None:
            cache = K3Cache(new_caches)
        return logits, loss, cache

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over labelled positions (in fp32 or fp64), plus the MoE auxiliary losses in training."""
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(wide.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        if self.training:
            for moe in self.moe_layers():
                loss = loss + moe.aux_loss + self.cfg.z_loss_weight * moe.z_loss
        return loss

    def _check_token_ids(self, tokens: torch.Tensor) -> None:
        """Token ids in [0, vocab_size), without waiting for a device: ids in host memory are read there (a
        ValueError naming the range found); on an accelerator ``torch._assert_async`` fails the stream instead."""
        if tokens.device.type != "cpu":
            low, high = torch.aminmax(tokens)
            torch._assert_async((low >= 0) & (high < self.cfg.vocab_size),
                                f"tokens must be ids in [0, vocab_size = {self.cfg.vocab_size})")
            return
        ids = tokens.numpy()  # host memory: a plain read, no device to wait for
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"tokens must be ids in [0, vocab_size = {self.cfg.vocab_size}), got ids in "
                             f"[{ids.min()}, {ids.max()}]")

    def _check_inputs(self, tokens, cache: K3Cache | None, targets) -> None:
        """The model boundary: the one place values are checked (token ids in the vocabulary,
        :meth:`_check_token_ids`, left out of a compiled graph, where the embedding's own bounds check catches a
        bad id)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be an int tensor [B, T], got {shape}")
        if tokens.shape[0] == 0 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must hold at least one sequence of at least one token, got shape "
                             f"{tuple(tokens.shape)}")
        if not torch.compiler.is_compiling():
            self._check_token_ids(tokens)
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape != tokens.shape):
            raise ValueError(f"targets must have the shape of tokens {tuple(tokens.shape)}, got "
                             f"{tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__}")
        if cache is None:
            return
        if not isinstance(cache, K3Cache) or len(cache.layers) != len(self.layers):
            raise ValueError(f"cache must be a K3Cache from this model's new_cache ({len(self.layers)} layers)")
        if cache.batch_size != tokens.shape[0]:
            raise ValueError(f"cache holds {cache.batch_size} sequences but tokens has batch {tokens.shape[0]}")
        kinds = [isinstance(c, KDACache) for c in cache.layers]
        if kinds != [layer.mixer_kind == "kda" for layer in self.layers]:
            raise ValueError("cache was made by a model with another layer schedule (KDA / MLA per layer)")

    # --- generation ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, seed: int | None = None) -> torch.Tensor:
        """Continue ``tokens`` [B, T] by ``max_new_tokens`` sampled tokens -> [B, T + max_new_tokens].

        Prefill runs the prompt through once (the chunked KDA path for prompts longer than a chunk), then each
        new token is one cached step: the KDA recurrent step and absorbed MLA. temperature 0 is greedy; top_k
        keeps the k most likely tokens; seed makes the sampling reproducible.
        """
        return torch.cat([tokens, *self.stream(tokens, max_new_tokens, temperature, top_k, seed)], dim=1)

    def stream(self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
               top_k: int | None = None, seed: int | None = None) -> Iterator[torch.Tensor]:
        """The tokens :meth:`generate` appends, one [B, 1] tensor at a time, each as soon as it is sampled (the
        arguments are checked at the call; the model is in eval mode until the iterator ends)."""
        if not is_number(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int ≥ 0, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be ≥ 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= self.cfg.vocab_size):
            raise ValueError(f"top_k must be None or an int in [1, vocab_size = {self.cfg.vocab_size}], got {top_k!r}")
        return self._sampled(tokens, max_new_tokens, temperature, top_k, seed)

    def _sampled(self, tokens, max_new_tokens, temperature, top_k, seed) -> Iterator[torch.Tensor]:
        was_training = self.training
        self.eval()
        try:
            generator = None if seed is None else torch.Generator(tokens.device).manual_seed(seed)
            cache = self.new_cache(tokens.shape[0], tokens.shape[1] + max_new_tokens, device=tokens.device)
            step_input = tokens
            for _ in range(max_new_tokens):
                logits, _, cache = self(step_input, cache)
                step_input = sample_next(logits[:, -1], temperature, top_k, generator)  # [B, 1]
                yield step_input
        finally:
            self.train(was_training)


def attnres_decoder_layer(embedding: torch.Tensor, outputs: list[torch.Tensor], queries: torch.Tensor,
                          block_size: int, mixer, ffn, mixer_norm, ffn_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer in Block AttnRes order, from the outputs so far (what :class:`DecoderLayer` does
    through the residual stream):

        a = mixer(mixer_norm(read(queries[0]; v_0, blocks of outputs)))
        f = ffn(ffn_norm(read(queries[1]; v_0, blocks of outputs + [a])))      the FFN reads the mixer's output

    embedding [B, T, D]; outputs: earlier sub-layer outputs, each [B, T, D]; queries [2, D]; block_size in
    sub-layers; mixer, ffn, norms: [B, T, D] -> [B, T, D]. Returns (a, f).
    """
    mixed = mixer(mixer_norm(block_attnres_read(embedding, outputs, queries[0], block_size)))
    fed = ffn(ffn_norm(block_attnres_read(embedding, [*outputs, mixed], queries[1], block_size)))
    return mixed, fed


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from logits [B, vocab]: argmax when temperature is 0, else softmax(logits / temperature)
    restricted to the top_k largest. Returns [B, 1] int64."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


# --- which parameter belongs to which component (accounting) ----------------------------------------------

def _component_of(model: K3Model, name: str, numel: int) -> tuple[str, int]:
    """(component, active numel) of parameter ``name``: routed experts are active top_k / n_routed_experts
    of the time."""
    head = name.split(".")[0]
    if head in ("embed", "lm_head"):
        return ("embedding" if head == "embed" else "lm_head"), numel
    if head in ("residual", "final_norm") or name.split(".")[2] in ("mixer_norm", "ffn_norm"):
        return "norms_and_residual", numel
    layer = model.layers[int(name.split(".")[1])]
    if ".mixer." in name:
        return f"{layer.mixer_kind}_attention", numel
    if layer.ffn_kind == "dense":
        return "dense_ffn", numel
    if ".ffn.experts." in name:
        return "routed_experts", numel // layer.ffn.n_routed_experts * layer.ffn.top_k
    if ".ffn.shared." in name:
        return "shared_experts", numel
    if name.endswith("ffn.router"):
        return "router", numel
    return "latent_projections", numel
