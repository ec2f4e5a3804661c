"""Gated multi-head latent attention (MLA): K3's global-attention layer, with its compressed KV cache.

Per token x ∈ R^d (lesson 09; shapes in the K3 sizes):

    c_Q = RMSNorm(W_DQ x)                         [1536]
    q_h = W_UQ[h] c_Q = [q_nope_h ; q_rope_h]     [128 ; 64] for each of H heads
    [c_KV ; k_rope] = W_DKV x, c = RMSNorm(c_KV)  [512 ; 64]  <- the only thing cached: 576 numbers per token
    k_nope_h = W_UK[h] c,  v_h = W_UV[h] c        [128], [128]
    o_h(t) = Σ_{s≤t} softmax_s((q_nope_h·k_nope_h(s) + q_rope_h·k_rope(s)) / sqrt(128 + 64)) v_h(s)
    y = W_O [σ(W_G x) ⊙ concat_h o_h]             full-rank sigmoid output gate (K3)

NoPE by default (K3, Kimi Linear): the "rope" dims are a shared, unrotated key part. ``use_rope=True`` rotates
them by absolute position (DeepSeek-V3, Kimi K2), in half-split pairs (i, i + r/2) or, ``rope_interleaved``, in the
pairs (2i, 2i + 1) DeepSeek checkpoints store; :class:`YaRN` stretches the frequencies for long contexts.

Two ways to attend over the cache, equal in exact arithmetic:
naive    up-project every cached latent to k_nope and v for every head, then attend (cost grows with T·H·r·d_h);
absorbed fold W_UK into the query (q̃_h = W_UK[h]ᵀ q_nope_h ∈ R^r) and W_UV into the output
         (o_h = W_UV[h] Σ_s p_s c_s), so attention runs directly over the 576-wide cache.

The naive path attends through ``torch.nn.functional.scaled_dot_product_attention`` (:func:`attend_sdpa`: a
fused kernel that does not store the [T, S] scores); :func:`attend_softmax` writes the same softmax out (the
lesson's rung, and the absorbed path's: decoding's few queries make a small score matrix, nothing to fuse away).

The module-level functions count cache sizes for the KV-cache comparison (MHA / GQA / MLA / the KDA state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3course.guards import is_number
from k3course.ops.checks import check_mixer_input
from k3course.ops.norm import NORM_EPS
from k3course.params import no_weight_decay, residual_output
from k3course.parts import part

DECODE_TOKENS = 64  # at inference, up to this many new tokens attend in the absorbed form (auto path)


class MLACache:
    """The compressed KV cache of one gated-MLA layer, preallocated and filled in place.

    Buffers ``[B, capacity, kv_lora_rank]`` and ``[B, capacity, qk_rope_head_dim]``; the first ``length`` positions
    are filled. ``latent`` and ``rope_key`` are views of the filled part:

    latent:   [B, S, kv_lora_rank]     RMSNorm(c_KV) of every token so far
    rope_key: [B, S, qk_rope_head_dim] the shared rope key (rotated when RoPE is on)

    Per token it holds kv_lora_rank + qk_rope_head_dim numbers (576 at K3 size), whatever the head count.
    :meth:`append` writes new tokens by slice assignment and doubles the capacity when it runs out (never a
    ``torch.cat`` per token). ``MLACache(latent, rope_key)`` wraps filled tensors (capacity = their length);
    :meth:`empty` makes a cache with room for ``capacity`` tokens.
    """

    def __init__(self, latent: torch.Tensor, rope_key: torch.Tensor, length: int | None = None):
        if latent.dim() != 3 or rope_key.dim() != 3 or latent.shape[:2] != rope_key.shape[:2]:
            raise ValueError(f"latent [B, S, r] and rope_key [B, S, rope] must agree on B and S, got "
                             f"{tuple(latent.shape)} and {tuple(rope_key.shape)}")
        self._latent, self._rope_key = latent, rope_key
        self.length = latent.shape[1] if length is None else length

    @classmethod
    def empty(cls, batch: int, capacity: int, kv_lora_rank: int, qk_rope_head_dim: int, device=None,
              dtype=None) -> MLACache:
        """A cache for ``batch`` sequences with room for ``capacity`` tokens, none filled."""
        latent = torch.zeros(batch, capacity, kv_lora_rank, device=device, dtype=dtype)
        return cls(latent, torch.zeros(batch, capacity, qk_rope_head_dim, device=device, dtype=dtype), 0)

    @property
    def latent(self) -> torch.Tensor:
        return self._latent[:, :self.length]

    @property
    def rope_key(self) -> torch.Tensor:
        return self._rope_key[:, :self.length]

    @property
    def batch_size(self) -> int:
        return self._latent.shape[0]

    @property
    def capacity(self) -> int:
        return self._latent.shape[1]

    @property
    def numbers_per_token(self) -> int:
        """Cached numbers per token (per layer): kv_lora_rank + qk_rope_head_dim."""
        return self._latent.shape[-1] + self._rope_key.shape[-1]

    def nbytes(self) -> int:
        """Bytes of the filled part, B · length · (kv_lora_rank + rope) · element size: what decoding must hold
        (and read every step). :meth:`allocated_nbytes` counts the whole preallocated buffer."""
        return self.batch_size * self.length * self.numbers_per_token * self._latent.element_size()

    def allocated_nbytes(self) -> int:
        """Bytes of the buffers, filled or not."""
        return sum(t.numel() * t.element_size() for t in (self._latent, self._rope_key))

    def append(self, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        """Write T new tokens' entries at positions length … length + T − 1 (in place, growing by doubling)."""
        self._latent, end = write_rows(self._latent, self.length, latent)
        self._rope_key, _ = write_rows(self._rope_key, self.length, rope_key)
        self.length = end


def write_rows(buffer: torch.Tensor, length: int, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Append rows to a preallocated cache buffer: buffer[:, length : length + T] = rows.

    buffer [B, capacity, w] with its first ``length`` positions filled; rows [B, T, w]. When they fit, the
    buffer is written in place and returned; otherwise a buffer of capacity max(length + T, 2·capacity) is
    allocated, the filled part copied over, and the rows written there (amortised O(1) per token, like a
    Python list). Returns (buffer, length + T).
    """
    end = length + rows.shape[1]
    if end > buffer.shape[1]:
        grown = buffer.new_zeros(buffer.shape[0], max(end, 2 * buffer.shape[1]), buffer.shape[2])
        grown[:, :length] = buffer[:, :length]
        buffer = grown
    buffer[:, length:end] = rows
    return buffer, end


@dataclass(frozen=True)
class YaRN:
    """YaRN's context extension of RoPE (Peng et al. 2023), computed as DeepSeek-V3 and transformers compute it.

    factor s, original_context L₀ (the pretraining length), beta_fast / beta_slow (rotation counts that bound
    the ramp), mscale / mscale_all_dim (0: unset). For a rope width r and base θ, pair i has ω_i = θ^(-2i/r):

        d(β) = r·ln(L₀ / (2πβ)) / (2 ln θ)                         the pair that turns β times over L₀
        lo = max(⌊d(beta_fast)⌋, 0), hi = min(⌈d(beta_slow)⌉, r − 1), ramp_i = clamp((i − lo) / (hi − lo), 0, 1)
        ω'_i = ramp_i · ω_i / s + (1 − ramp_i) · ω_i               fast pairs keep ω_i, slow ones are interpolated
        rope_gain  = m(s, mscale) / m(s, mscale_all_dim) if both are set, else m(s, 1)   (multiplies cos and sin)
        score_gain = m(s, mscale_all_dim)² if it is set, else 1                          (multiplies the softmax scale)

    with m(s, μ) = 1 + 0.1·μ·ln s for s > 1, else 1. DeepSeek-V3: s = 40, L₀ = 4096, β 32 / 1, mscale 1 / 1.
    """

    factor: float
    original_context: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> YaRN | None:
        """The YaRN of a :class:`k3course.config.K3Config` (its rope_yarn_* fields), None without one."""
        if cfg.rope_yarn_factor is None:
            return None
        return cls(cfg.rope_yarn_factor, cfg.rope_yarn_original_context, cfg.rope_yarn_beta_fast,
                   cfg.rope_yarn_beta_slow, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim)

    def inv_freq(self, dim: int, theta: float, device=None, dtype=torch.float32) -> torch.Tensor:
        """ω'_i for the r/2 pairs of a rope width ``dim`` [dim / 2]."""
        def pair_turning(rotations: float) -> float:
            return dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(pair_turning(self.beta_fast)), 0)
        high = min(math.ceil(pair_turning(self.beta_slow)), dim - 1)
        pairs = torch.arange(dim // 2, device=device, dtype=dtype)
        ramp = ((pairs - low) / ((high - low) or 0.001)).clamp(0, 1)
        base = 1.0 / theta ** (2 * pairs / dim)
        return ramp * base / self.factor + (1 - ramp) * base

    @property
    def rope_gain(self) -> float:
        if self.mscale and self.mscale_all_dim:
            return _yarn_m(self.factor, self.mscale) / _yarn_m(self.factor, self.mscale_all_dim)
        return _yarn_m(self.factor, 1.0)

    @property
    def score_gain(self) -> float:
        return _yarn_m(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def _yarn_m(factor: float, mscale: float) -> float:
    """m(s, μ) = 1 + 0.1·μ·ln s for s > 1, else 1."""
    return 1.0 + 0.1 * mscale * math.log(factor) if factor > 1 else 1.0


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0, interleaved: bool = False,
                yarn: YaRN | None = None) -> torch.Tensor:
    """RoPE: rotate pairs of x by positions·ω_i, ω_i = theta^(-2i/r) (or YaRN's ω'_i, with cos and sin scaled
    by its rope_gain). Pair i is (x[i], x[i + r/2]) (half-split) or (x[2i], x[2i + 1]) (``interleaved``); the
    layout is kept, so q·k is the same either way for weights laid out to match.

    x: [B, T, ..., r]; positions: [T] (absolute). Shape kept.
    """
    half, wide = x.shape[-1] // 2, torch.promote_types(x.dtype, torch.float32)
    if yarn is None:
        inv_freq, gain = theta ** (-torch.arange(half, device=x.device, dtype=wide) * 2.0 / x.shape[-1]), 1.0
    else:
        inv_freq, gain = yarn.inv_freq(x.shape[-1], theta, x.device, wide), yarn.rope_gain
    angle = positions.to(wide)[:, None] * inv_freq                          # [T, r/2]
    angle = angle.view(1, angle.shape[0], *([1] * (x.dim() - 3)), half)     # broadcast over B and heads
    cos, sin = angle.cos() * gain, angle.sin() * gain
    if interleaved:
        first, second = x[..., 0::2].to(wide), x[..., 1::2].to(wide)
        rotated = torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1).flatten(-2)
    else:
        first, second = x[..., :half].to(wide), x[..., half:].to(wide)
        rotated = torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return rotated.to(x.dtype)


def compress_kv(x: torch.Tensor, kv_down_weight: torch.Tensor, kv_norm_weight: torch.Tensor, kv_lora_rank: int,
                eps: float = NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """What MLA caches for each token: [c_KV ; k_rope] = W_DKV x, then RMSNorm on c_KV only.

    x [B, T, d]; kv_down_weight [kv_lora_rank + rope, d]; kv_norm_weight [kv_lora_rank]
    -> (latent = RMSNorm(c_KV) [B, T, kv_lora_rank], rope_key [B, T, rope]).
    """
    compressed = x @ kv_down_weight.T                                       # [B, T, r + rope]
    latent = F.rms_norm(compressed[..., :kv_lora_rank], (kv_lora_rank,), kv_norm_weight, eps)
    return latent, compressed[..., kv_lora_rank:]


def absorb_query(q_nope: torch.Tensor, k_up: torch.Tensor) -> torch.Tensor:
    """Fold W_UK into the query: q̃_h = W_UK[h]ᵀ q_nope_h, so q̃_h·c = q_nope_h·(W_UK[h] c) for every latent c.

    q_nope [B, T, H, nope]; k_up [H, nope, kv_lora_rank] -> [B, T, H, kv_lora_rank].
    """
    return torch.einsum("bthn,hnr->bthr", q_nope, k_up)


def output_gate(heads: torch.Tensor, x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Gated MLA's output gate: σ(x W_Gᵀ) ⊙ heads, the gate read from the layer's input x, elementwise on the
    attention output. heads [B, T, H·v]; x [B, T, d]; gate_weight [H·v, d] -> [B, T, H·v]."""
    return torch.sigmoid(x @ gate_weight.T) * heads


def visible_keys(n_queries: int, n_keys: int, start: int, device=None) -> torch.Tensor:
    """The causal mask with a cache prefix: visible[t, s] = s ≤ start + t (query t sits at position start + t).

    Returns a bool [n_queries, n_keys]; with start = 0 and n_keys = n_queries it is the lower triangle.
    """
    query_pos = start + torch.arange(n_queries, device=device)
    return torch.arange(n_keys, device=device)[None, :] <= query_pos[:, None]


def attention_probs(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                    scale: float | None = None, start: int = 0) -> torch.Tensor:
    """Causal MLA attention weights p[b, h, t, s] = softmax_s((q_nope·k_nope + q_rope·k_rope) · scale), s ≤ start + t.

    q_nope [B, T, H, n], q_rope [B, T, H, e]; k_nope [B, S, H, n] per head, or [B, S, n] shared by all heads
    (the latent, for an absorbed query); k_rope [B, S, e] shared by all heads. scale defaults to (n + e)^-1/2;
    the absorbed path passes the original (nope + rope)^-1/2. Query t sits at position start + t. The softmax
    runs over the keys s, in fp32 or wider. Returns [B, H, T, S].
    """
    if scale is None:
        scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5
    nope = "bthn,bshn->bhts" if k_nope.dim() == 4 else "bthn,bsn->bhts"
    scores = (torch.einsum(nope, q_nope, k_nope) + torch.einsum("bthe,bse->bhts", q_rope, k_rope)) * scale
    visible = visible_keys(scores.shape[-2], scores.shape[-1], start, scores.device)     # [T, S]
    wide = scores.to(torch.promote_types(scores.dtype, torch.float32))
    return torch.softmax(wide.masked_fill(~visible, float("-inf")), dim=-1)


def attend_softmax(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                   values: torch.Tensor, scale: float, start: int = 0) -> torch.Tensor:
    """Causal attention written out: o[b, t, h] = Σ_s p[b, h, t, s] v[b, s, h], p from :func:`attention_probs`.

    The lesson's rung: the whole score matrix [B, H, T, S] is built, and autograd keeps it for the backward.
    q_nope [B, T, H, n], q_rope [B, T, H, e]; k_nope [B, S, H, n]; k_rope [B, S, e] (shared by the heads);
    values [B, S, H, v]; query t sits at position start + t. Returns o [B, T, H, v] in q_nope's dtype.
    """
    probs = attention_probs(q_nope, q_rope, k_nope, k_rope, scale, start)      # [B, H, T, S]
    return torch.einsum("bhts,bshv->bthv", probs, values.to(probs.dtype)).to(q_nope.dtype)


def attend_sdpa(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                values: torch.Tensor, scale: float, start: int = 0) -> torch.Tensor:
    """The same causal attention as :func:`attend_softmax`, through ``F.scaled_dot_product_attention``.

    q = [q_nope ; q_rope] and k = [k_nope ; k_rope] per head, so q·k = q_nope·k_nope + q_rope·k_rope. The fused
    kernels (flash on a CPU; flash or memory-efficient on CUDA) do not store the [T, S] scores but want one head
    width for q, k and v, so the narrower side is padded with zeros to w = max(n + e, v): zero query/key columns
    add nothing to q·k (the scale is passed, not derived from w), zero value columns give zero outputs, sliced
    off. With no cache prefix (start = 0) the mask is SDPA's is_causal (s ≤ t); a prefix shifts the diagonal,
    so the mask :func:`visible_keys` is passed explicitly; when every query sees every key (start ≥ S − 1: one
    new token after the prefix) there is none. Shapes as :func:`attend_softmax`; returns o [B, T, H, v].
    """
    n_queries, n_keys, value_width = q_nope.shape[1], k_nope.shape[1], values.shape[-1]
    shared_rope = k_rope[:, :, None, :].expand(-1, -1, k_nope.shape[2], -1)             # [B, S, H, e]
    query, key = torch.cat([q_nope, q_rope], dim=-1), torch.cat([k_nope, shared_rope], dim=-1)
    width = max(query.shape[-1], value_width)
    query, key, values = (_zero_pad_last(t, width).transpose(1, 2) for t in (query, key, values))   # [B, H, ·, w]
    sees_all = start >= n_keys - 1
    causal = start == 0 and not sees_all
    mask = None if sees_all or causal else visible_keys(n_queries, n_keys, start, q_nope.device)   # [T, S]
    out = F.scaled_dot_product_attention(query, key, values, attn_mask=mask, is_causal=causal, scale=scale)
    return out[..., :value_width].transpose(1, 2)                                      # [B, T, H, v]


def _zero_pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., w₀] with zeros appended to width w ≥ w₀ (x itself when w = w₀)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class GatedMLA(nn.Module):
    """Gated multi-head latent attention with a compressed KV cache.

    ``forward(x, cache=None)`` takes x [B, T, d_model] and an optional :class:`MLACache` of earlier tokens
    (from :meth:`new_cache`), and returns (y [B, T, d_model], the cache extended by these T tokens: a given cache
    is filled in place and returned). Causal: new token t sees every cached token and the new tokens up to t.
    ``absorbed`` picks how to attend: None (auto) uses the absorbed form at inference for at most
    ``DECODE_TOKENS`` new tokens (decoding) and the naive form otherwise; True / False force one (the same
    numbers). ``max_cache_len`` (optional) bounds the cache length. ``use_rope`` rotates the rope dims by
    ``rope_theta`` (:func:`rope_rotate`: ``rope_interleaved`` pairs, ``yarn`` scaling, whose score gain also
    multiplies the softmax scale); ``eps``: ε of the q and latent RMSNorms
    (the config's ``norm_eps``: 1e-5 in K3 and Kimi Linear, 1e-6 in DeepSeek-V3).
    ``sdpa`` (default) runs the naive path's attention through torch's fused ``scaled_dot_product_attention``
    (:func:`attend_sdpa`); False runs the written-out softmax (:func:`attend_softmax`), the lesson's rung. The
    absorbed path always uses the written-out softmax: it serves decoding, a few queries per step against the
    shared latent, where the score matrix [B, H, T, S] is small.
    ``kernels``: the backend (:func:`k3course.kernels.kernel_backend`; None: ``K3COURSE_KERNELS``, default "auto"),
    chosen here once. On CUDA (or with "triton") the naive path attends through lesson 09's Triton kernels
    (:func:`k3course.kernels.flash_mla.flash_mla_attention`, forward and backward), whatever ``sdpa`` says.
    """

    def __init__(self, d_model: int, n_heads: int, q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, gated: bool = True, use_rope: bool = False,
                 rope_theta: float = 10000.0, max_cache_len: int | None = None, absorbed: bool | None = None,
                 eps: float = NORM_EPS, device=None, dtype=None, rope_interleaved: bool = False,
                 yarn: YaRN | None = None, sdpa: bool = True, kernels: str | None = None):
        super().__init__()
        from k3course.kernels import kernel_backend  # imported here: the attention ops do not depend on the kernels

        self.kernels = kernel_backend(kernels)
        sizes = dict(d_model=d_model, n_heads=n_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                     v_head_dim=v_head_dim, q_lora_rank=1 if q_lora_rank is None else q_lora_rank)
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(qk_rope_head_dim, int) or qk_rope_head_dim < 0:
            raise ValueError(f"qk_rope_head_dim must be an int >= 0, got {qk_rope_head_dim!r}")
        if use_rope and qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE (it rotates pairs), got {qk_rope_head_dim}")
        if yarn is not None and not use_rope:
            raise ValueError("yarn scales RoPE: it needs use_rope=True")
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
        if absorbed not in (None, True, False):
            raise ValueError(f"absorbed must be None (auto), True or False, got {absorbed!r}")
        if not isinstance(sdpa, bool):
            raise TypeError(f"sdpa must be a bool, got {sdpa!r}")
        factory = dict(device=device, dtype=dtype)
        self.absorbed, self.sdpa = absorbed, sdpa
        self.n_heads, self.kv_lora_rank = n_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.gated, self.use_rope, self.rope_theta, self.max_cache_len = gated, use_rope, rope_theta, max_cache_len
        self.rope_interleaved, self.yarn = rope_interleaved, yarn
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * (1.0 if yarn is None else yarn.score_gain)
        self.d_model = d_model
        q_width = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:                                          # full-rank query (no compression)
            self.q_down, self.q_norm = None, None
            self.q_up = nn.Linear(d_model, q_width, bias=False, **factory)
        else:
            self.q_down = nn.Linear(d_model, q_lora_rank, bias=False, **factory)
            self.q_norm = nn.RMSNorm(q_lora_rank, eps=eps, **factory)
            no_weight_decay(self.q_norm.weight)
            self.q_up = nn.Linear(q_lora_rank, q_width, bias=False, **factory)
        self.kv_down = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=False, **factory)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=eps, **factory)
        no_weight_decay(self.kv_norm.weight)
        self.k_up = nn.Parameter(torch.empty(n_heads, qk_nope_head_dim, kv_lora_rank, **factory))
        self.v_up = nn.Parameter(torch.empty(n_heads, v_head_dim, kv_lora_rank, **factory))
        self.gate = nn.Linear(d_model, n_heads * v_head_dim, bias=False, **factory) if gated else None
        self.out = nn.Linear(n_heads * v_head_dim, d_model, bias=False, **factory)
        residual_output(self.out.weight)
        nn.init.normal_(self.k_up, std=kv_lora_rank ** -0.5)
        nn.init.normal_(self.v_up, std=kv_lora_rank ** -0.5)

    @classmethod
    def from_config(cls, cfg, **overrides) -> GatedMLA:
        """The MLA layer of a :class:`k3course.config.K3Config` (its mla_*, *_rank and rope_* fields; its q and
        latent RMSNorms take ``norm_eps``)."""
        sizes = dict(d_model=cfg.d_model, n_heads=cfg.mla_n_heads, q_lora_rank=cfg.q_lora_rank,
                     kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                     qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, gated=cfg.mla_gated,
                     use_rope=cfg.mla_rope, rope_theta=cfg.rope_theta, rope_interleaved=cfg.rope_interleaved,
                     yarn=YaRN.from_config(cfg) if cfg.mla_rope else None, eps=cfg.norm_eps)
        return cls(**{**sizes, **overrides})

    # --- the pieces ---------------------------------------------------------------------------------------

    def compress(self, x: torch.Tensor, positions: torch.Tensor) -> MLACache:
        """The cache entries of x: [RMSNorm(c_KV) ; k_rope]. x: [B, T, d] -> latent [B, T, r], rope [B, T, rope]."""
        latent, rope_key = compress_kv(x, self.kv_down.weight, self.kv_norm.weight, self.kv_lora_rank,
                                       self.kv_norm.eps)
        if self.use_rope:
            rope_key = rope_rotate(rope_key, positions, self.rope_theta, self.rope_interleaved, self.yarn)
        return MLACache(latent, rope_key)

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q through the low-rank path. x: [B, T, d] -> q_nope [B, T, H, nope], q_rope [B, T, H, rope]."""
        q = self.q_up(x if self.q_down is None else self.q_norm(self.q_down(x)))
        q = q.view(*x.shape[:2], self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        if self.use_rope:
            q_rope = rope_rotate(q_rope, positions, self.rope_theta, self.rope_interleaved, self.yarn)
        return q_nope, q_rope

    def attend_naive(self, q_nope, q_rope, cache: MLACache, start: int) -> torch.Tensor:
        """Up-project the whole cache to per-head keys and values, then attend (the Triton kernels when the
        backend says so, else :func:`attend_sdpa`, or the written-out :func:`attend_softmax` when ``sdpa`` is off).
        Returns o [B, T, H, v]."""
        from k3course.kernels import use_triton  # imported here: the attention ops do not depend on the kernels

        k_nope = torch.einsum("bsr,hnr->bshn", cache.latent, self.k_up)     # [B, S, H, nope]
        values = torch.einsum("bsr,hvr->bshv", cache.latent, self.v_up)     # [B, S, H, v]
        if use_triton(q_nope.device, self.kernels):
            from k3course.kernels.flash_mla import flash_mla_attention as attend
        else:
            attend = attend_sdpa if self.sdpa else attend_softmax
        return attend(q_nope, q_rope, k_nope, cache.rope_key, values, self.scale, start)

    def attend_absorbed(self, q_nope, q_rope, cache: MLACache, start: int) -> torch.Tensor:
        """Attend over the latent cache itself: W_UK folded into the query, W_UV applied after. o [B, T, H, v]."""
        q_latent = absorb_query(q_nope, self.k_up)                           # [B, T, H, r]
        probs = attention_probs(q_latent, q_rope, cache.latent, cache.rope_key, self.scale, start)
        latent_context = torch.einsum("bhts,bsr->bthr", probs, cache.latent.to(probs.dtype))   # [B, T, H, r]
        return torch.einsum("bthr,hvr->bthv", latent_context.to(q_nope.dtype), self.v_up)

    # --- the layer ----------------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> MLACache:
        """An empty cache for ``batch`` sequences with room for ``max_len`` tokens (it grows if more come).
        device and dtype default to the layer's parameters'."""
        for name, value in (("batch", batch), ("max_len", max_len)):
            if not is_number(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        weight = self.kv_down.weight
        return MLACache.empty(batch, max_len, self.kv_lora_rank, self.qk_rope_head_dim, device or weight.device,
                              dtype or weight.dtype)

    def uses_absorbed(self, n_tokens: int) -> bool:
        """The path rule: absorbed when forced, else at inference for at most DECODE_TOKENS new tokens."""
        if self.absorbed is not None:
            return self.absorbed
        return not self.training and n_tokens <= DECODE_TOKENS

    def _check_inputs(self, x: torch.Tensor, cache: MLACache | None) -> int:
        """Validate x and the cache (metadata only, no host read); return the number of cached tokens."""
        check_mixer_input(x, self.d_model)
        if cache is None:
            start = 0
        elif not isinstance(cache, MLACache):
            raise TypeError(f"cache must be an MLACache (or None), got {type(cache).__name__}")
        else:
            if (cache.batch_size != x.shape[0] or cache.latent.shape[-1] != self.kv_lora_rank
                    or cache.rope_key.shape[-1] != self.qk_rope_head_dim):
                raise ValueError(f"cache does not match this layer and batch: expected latent [B={x.shape[0]}, S, "
                                 f"{self.kv_lora_rank}] and rope_key [B, S, {self.qk_rope_head_dim}], got "
                                 f"{tuple(cache.latent.shape)} and {tuple(cache.rope_key.shape)}")
            if cache.latent.dtype != x.dtype or cache.latent.device != x.device:
                raise ValueError(f"cache is {cache.latent.dtype} on {cache.latent.device}, x is {x.dtype} on "
                                 f"{x.device}: they must match")
            start = cache.length
        if self.max_cache_len is not None and start + x.shape[1] > self.max_cache_len:
            raise ValueError(f"x: {start} cached + {x.shape[1]} new tokens exceed max_cache_len={self.max_cache_len}")
        return start

    def forward(self, x: torch.Tensor, cache: MLACache | None = None,
                absorbed: bool | None = None) -> tuple[torch.Tensor, MLACache]:
        """y = W_O[σ(W_G x) ⊙ MLA(x)]. x: [B, T, d] -> (y [B, T, d], cache with S + T tokens).

        ``absorbed`` overrides the layer's path rule for this call (None: :meth:`uses_absorbed`)."""
        start = self._check_inputs(x, cache)
        positions = torch.arange(start, start + x.shape[1], device=x.device)
        new = self.compress(x, positions)
        if cache is None:
            cache = new
        else:
            cache.append(new.latent, new.rope_key)
        q_nope, q_rope = self.queries(x, positions)
        use_absorbed = self.uses_absorbed(x.shape[1]) if absorbed is None else absorbed
        attend = self.attend_absorbed if use_absorbed else self.attend_naive
        heads = attend(q_nope, q_rope, cache, start).flatten(2)                # [B, T, H·v]
        if self.gated:
            heads = part("mla_output_gate", output_gate)(heads, x, self.gate.weight)  # a learner's, if held
        return self.out(heads), cache


# --- cache and cost accounting (numbers per token per layer; multiply by bytes per number) -------------------
