"""The token-mixer layers around the ops: Kimi Delta Attention, Gated DeltaNet, decayed linear attention.

DESIGN §6, per head: q, k = L2Norm(SiLU(ShortConv4(W x))); v = SiLU(ShortConv4(W_v x)); β = σ(W_β x);
a forget gate g ≤ 0; o = op(q, k, v, g, β); y = W_o[σ(gate(x)) ⊙ RMSNorm_head(o)].

``forward(x, state=None)`` returns ``(y, state)``: the state holds the last ``conv_size − 1`` inputs of each
short convolution and the recurrent state ``[B, H, K, V]``, so feeding a sequence in pieces (down to one token
at a time) gives the same outputs as feeding it whole.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from k3course.attention.chunk import gdn_chunk, gla_chunk, kda_chunk
from k3course.attention.recurrent import gdn_recurrent, gla_recurrent, kda_recurrent
from k3course.norm import rms_norm

KDA_LOWER_BOUND = -5.0  # K3's bounded forget gate: g ∈ (−5, 0), so α ∈ (e^-5, 1)


class MixerState(NamedTuple):
    """What a layer carries between calls: conv tails ``[B, conv_size − 1, channels]`` and ``[B, H, K, V]``."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor


def short_conv(x, weight, cache=None):
    """Causal depthwise convolution: y_t[c] = Σ_j weight[c, j] · x_{t − (W−1) + j}[c], with zeros (or
    ``cache``) before t = 0.

    x ``[B, T, C]``; weight ``[C, W]``; cache ``[B, W − 1, C]`` (the previous inputs) or None.
    Returns ``(y [B, T, C], new_cache [B, W − 1, C])``. No activation.
    """
    width = weight.shape[-1]
    if cache is None:
        cache = x.new_zeros(x.shape[0], width - 1, x.shape[-1])
    padded = torch.cat([cache, x], dim=1)  # [B, W − 1 + T, C]
    y = F.conv1d(padded.transpose(1, 2), weight.unsqueeze(1), groups=x.shape[-1]).transpose(1, 2)
    return y, padded[:, padded.shape[1] - (width - 1):]


def kda_gate(z, A_log, dt_bias, lower_bound=KDA_LOWER_BOUND):
    """The KDA forget gate (log-decay) from the low-rank projection ``z [B, T, H, K]``.

    K3 (bounded):          g = lower_bound · σ(e^{A_log} ⊙ (z + dt_bias)),  g ∈ (lower_bound, 0)
    Kimi Linear (None):    g = −e^{A_log} ⊙ softplus(z + dt_bias),           g ∈ (−∞, 0)
    A_log ``[H]`` (one rate per head), dt_bias ``[H, K]``.
    """
    rate = A_log.exp()[:, None]  # [H, 1]
    if lower_bound is None:
        return -rate * F.softplus(z + dt_bias)
    return lower_bound * torch.sigmoid(rate * (z + dt_bias))


def initial_dt_bias(count: int, lower_bound: float | None, slowest=0.01, fastest=0.5) -> torch.Tensor:
    """dt_bias that starts the forget gates spread geometrically between −g = ``slowest`` and ``fastest``
    (α from e^-0.01 to e^-0.5) with z = 0 and A_log = 0: memories of ~2 to ~100 tokens from step one."""
    target = torch.logspace(math.log10(slowest), math.log10(fastest), count)  # −g, [count]
    if lower_bound is None:
        return torch.log(torch.expm1(target))  # softplus(dt_bias) = −g
    return torch.logit(target / -lower_bound)  # lower_bound · σ(dt_bias) = g


class ShortConv(nn.Module):
    """Depthwise causal conv of width ``kernel_size`` over ``channels``, followed by SiLU."""

    def __init__(self, channels: int, kernel_size: int = 4):
        super().__init__()
        bound = 1 / math.sqrt(kernel_size)
        self.weight = nn.Parameter(torch.empty(channels, kernel_size).uniform_(-bound, bound))

    def forward(self, x, cache=None):
        y, cache = short_conv(x, self.weight, cache)
        return F.silu(y), cache


class _GatedMixer(nn.Module):
    """Shared body of the three layers; subclasses define the forget gate and which op mixes the tokens."""

    uses_beta = True

    def __init__(self, d_model: int, n_heads: int, head_dim: int, conv_size: int = 4,
                 full_rank_output_gate: bool = False, norm_eps: float = 1e-6, mode: str = "chunk",
                 chunk_size: int = 64, allow_neg_eigval: bool = False):
        super().__init__()
        if mode not in ("chunk", "recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'recurrent', got {mode!r}")
        self.n_heads, self.head_dim, self.mode, self.chunk_size = n_heads, head_dim, mode, chunk_size
        self.norm_eps, self.allow_neg_eigval = norm_eps, allow_neg_eigval
        width = n_heads * head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, width, bias=False) for _ in range(3))
        self.q_conv, self.k_conv, self.v_conv = (ShortConv(width, conv_size) for _ in range(3))
        self.b_proj = nn.Linear(d_model, n_heads, bias=False) if self.uses_beta else None
        if full_rank_output_gate:  # K3
            self.gate_proj = nn.Linear(d_model, width, bias=False)
        else:  # Kimi Linear: low rank, d -> head_dim -> H·V
            self.gate_proj = nn.Sequential(nn.Linear(d_model, head_dim, bias=False), nn.Linear(head_dim, width))
        self.o_norm_weight = nn.Parameter(torch.ones(head_dim))
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def _heads(self, x):
        return x.unflatten(-1, (self.n_heads, self.head_dim))  # [B, T, H·D] -> [B, T, H, D]

    def log_decay(self, x):
        raise NotImplementedError

    def mix(self, q, k, v, g, beta, initial_state):
        """The one place the layer calls its op: ``(o [B, T, H, V], final_state [B, H, K, V])``."""
        raise NotImplementedError

    def forward(self, x, state: MixerState | None = None):
        """x ``[B, T, d_model]`` -> ``(y [B, T, d_model], MixerState)``; ``state`` continues a sequence."""
        if x.dim() != 3:
            raise ValueError(f"x must be [B, T, d_model], got shape {tuple(x.shape)}")
        q, conv_q = self.q_conv(self.q_proj(x), None if state is None else state.conv_q)
        k, conv_k = self.k_conv(self.k_proj(x), None if state is None else state.conv_k)
        v, conv_v = self.v_conv(self.v_proj(x), None if state is None else state.conv_v)
        q, k = F.normalize(self._heads(q), dim=-1), F.normalize(self._heads(k), dim=-1)
        beta = None
        if self.uses_beta:
            beta = torch.sigmoid(self.b_proj(x))  # [B, T, H]
            if self.allow_neg_eigval:
                beta = 2 * beta  # β ∈ (0, 2): I − β k kᵀ may then flip the sign along k
        o, recurrent = self.mix(q, k, self._heads(v), self.log_decay(x), beta,
                                None if state is None else state.recurrent)
        o = rms_norm(o, self.o_norm_weight, self.norm_eps).flatten(-2)  # [B, T, H·V]
        y = self.o_proj(torch.sigmoid(self.gate_proj(x)) * o)
        return y, MixerState(conv_q, conv_k, conv_v, recurrent)


class KimiDeltaAttention(_GatedMixer):
    """KDA layer: channel-wise forget gate from a low-rank projection (d -> head_dim -> H·K) plus a bias.

    ``lower_bound=-5.0`` is K3's bounded gate g = −5·σ(e^{A_log}(z + dt_bias)); ``lower_bound=None`` is
    Kimi Linear's g = −e^{A_log}·softplus(z + dt_bias). Keyword options (shared by the three layers):
    ``conv_size`` (4), ``full_rank_output_gate`` (K3: True; Kimi Linear's low-rank gate: False), ``norm_eps``,
    ``mode`` ("chunk" for training and prefill, or "recurrent"), ``chunk_size`` (64), ``allow_neg_eigval``.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, lower_bound: float | None = KDA_LOWER_BOUND,
                 **kwargs):
        super().__init__(d_model, n_heads, head_dim, **kwargs)
        self.lower_bound = lower_bound
        self.f_proj = nn.Sequential(nn.Linear(d_model, head_dim, bias=False),
                                    nn.Linear(head_dim, n_heads * head_dim, bias=False))
        self.A_log = nn.Parameter(torch.zeros(n_heads))
        self.dt_bias = nn.Parameter(initial_dt_bias(n_heads * head_dim, lower_bound).view(n_heads, head_dim))

    def log_decay(self, x):
        return kda_gate(self._heads(self.f_proj(x)), self.A_log, self.dt_bias, self.lower_bound)

    def mix(self, q, k, v, g, beta, initial_state):
        if self.mode == "recurrent":
            return kda_recurrent(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                 allow_neg_eigval=self.allow_neg_eigval)
        from k3course.kernels import use_triton  # imported here: importing it picks native vs interpreter

        if use_triton(q.device):  # CUDA, or forced by K3COURSE_KERNELS=triton: the chapter 08 kernels
            from k3course.kernels.kda import kda_triton

            return kda_triton(q, k, v, g, beta, initial_state, self.chunk_size)
        return kda_chunk(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                         chunk_size=self.chunk_size, allow_neg_eigval=self.allow_neg_eigval)


class GatedDeltaNet(_GatedMixer):
    """GDN layer: one forget rate per head, g = −e^{A_log}·softplus(W_a x + dt_bias) (Mamba2-style)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, **kwargs):
        super().__init__(d_model, n_heads, head_dim, **kwargs)
        self.a_proj = nn.Linear(d_model, n_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(n_heads))
        self.dt_bias = nn.Parameter(initial_dt_bias(n_heads, None))

    def log_decay(self, x):
        return -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)  # [B, T, H]

    def mix(self, q, k, v, g, beta, initial_state):
        if self.mode == "recurrent":
            return gdn_recurrent(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                 allow_neg_eigval=self.allow_neg_eigval)
        return gdn_chunk(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                         chunk_size=self.chunk_size, allow_neg_eigval=self.allow_neg_eigval)


class DecayedLinearAttention(GatedDeltaNet):
    """Linear attention with a scalar forget gate per head and no delta rule: S_t = α_t S_{t-1} + k_t v_tᵀ.

    The same layer as :class:`GatedDeltaNet` minus β (the baseline of the recall comparison).
    """

    uses_beta = False

    def mix(self, q, k, v, g, beta, initial_state):
        if self.mode == "recurrent":
            return gla_recurrent(q, k, v, g, initial_state=initial_state, output_final_state=True)
        return gla_chunk(q, k, v, g, initial_state=initial_state, output_final_state=True,
                         chunk_size=self.chunk_size)
