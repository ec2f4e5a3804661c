"""The token-mixer layers around the ops: Kimi Delta Attention, Gated DeltaNet, decayed linear attention.

Per head (lesson 06; the Kimi Linear paper):
q, k = L2Norm(SiLU(ShortConv4(W x))); v = SiLU(ShortConv4(W_v x)); β = σ(W_β x);
a forget gate g ≤ 0; o = op(q, k, v, g, β); y = W_o[σ(gate(x)) ⊙ RMSNorm_head(o)].

``forward(x, cache=None)`` returns ``(y, cache)``: a :class:`KDACache` holding the last ``conv_size − 1`` inputs
of each short convolution and the fp32 recurrent state ``[B, H, K, V]``, so feeding a sequence in pieces (down to
one token at a time) gives the same outputs as feeding it whole. A given cache is updated in place and returned.

Path: ``mode="auto"`` runs the chunked op in training and for more than ``chunk_size`` tokens (prefill), and the
recurrent step otherwise (decoding one token is one step, not a chunk padded to 64), as fla's layers do;
``"chunk"`` and ``"recurrent"`` force one. Both give the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3course.guards import is_number
from k3course.ops.checks import check_kda_chunk_size, check_mixer_input
from k3course.ops.chunk import gdn_chunk, gla_chunk, kda_chunk
from k3course.ops.norm import NORM_EPS, rms_norm
from k3course.ops.recurrent import gdn_recurrent, gla_recurrent, kda_recurrent
from k3course.params import forget_gate, no_weight_decay, residual_output
from k3course.parts import is_replaced, part

KDA_LOWER_BOUND = -5.0  # K3's bounded forget gate: g ∈ (−5, 0), so α ∈ (e^-5, 1)
MODES = ("auto", "chunk", "recurrent")
OUTPUT_GATES = ("full", "low_rank")  # K3: full rank; Kimi Linear: low rank
CHUNK_SIZE = 32  # tokens per chunk of the chunked op: every size gives the same numbers; on a CPU the torch ops of
# a training step at K3's head sizes run 20–30 % faster at 32 than at fla's 64 (the intra-chunk work grows with C²)


@dataclass
class KDACache:
    """What a KDA / GDN / decayed-linear-attention layer carries between calls, for a batch of B sequences.

    conv_q, conv_k ``[B, conv_size − 1, H·K]``, conv_v ``[B, conv_size − 1, H·V]``: the last inputs of the short
    convolutions, in the activation dtype; state ``[B, H, K, V]``: the recurrent memory S, float32 (as in fla)
    whatever the activations' dtype, or float64 for float64 activations; length: tokens seen. Its size does not
    depend on the length.
    """

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    state: torch.Tensor
    length: int = 0

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    def nbytes(self) -> int:
        """Bytes held: the state plus the three conv tails (all of it is in use, at any length)."""
        return sum(t.numel() * t.element_size() for t in (self.conv_q, self.conv_k, self.conv_v, self.state))


def short_conv(x, weight, cache=None):
    """Causal depthwise convolution: y_t[c] = Σ_j weight[c, j] · x_{t − (W−1) + j}[c], with zeros (or
    ``cache``) before t = 0.

    x ``[B, T, C]``; weight ``[C, W]``; cache ``[B, W − 1, C]`` (the previous inputs) or None.
    Returns ``(y [B, T, C], new_cache [B, W − 1, C])``. No activation.
    """
    width, time = weight.shape[-1], x.shape[1]
    weight = weight.to(x.dtype)  # under autocast x is bf16 while the weight stays fp32 (conv1d would cast it too)
    if cache is None:
        cache = x.new_zeros(x.shape[0], width - 1, x.shape[-1])
    padded = torch.cat([cache, x], dim=1)  # [B, W − 1 + T, C]: x_{t − (W−1) + j} is padded[:, t + j]
    y = padded[:, :time] * weight[:, 0]
    for j in range(1, width):  # W shifted multiply-adds in the token layout: cheaper than conv1d's transposes
        y = torch.addcmul(y, padded[:, j:j + time], weight[:, j])
    return y, padded[:, time:]


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


def gdn_gate(a, A_log, dt_bias):
    """The GDN forget gate (log-decay), one per head: g = −e^{A_log} ⊙ softplus(a + dt_bias), a ``[..., H]``
    (W_a x), A_log and dt_bias ``[H]``; g ∈ (−∞, 0)."""
    return -A_log.exp() * F.softplus(a + dt_bias)


def initial_dt_bias(count: int, lower_bound: float | None, slowest=0.01, fastest=0.5) -> torch.Tensor:
    """dt_bias that starts the forget gates spread geometrically between −g = ``slowest`` and ``fastest``
    (α from e^-0.01 to e^-0.5) with z = 0 and A_log = 0: memories of ~2 to ~100 tokens from step one."""
    target = torch.logspace(math.log10(slowest), math.log10(fastest), count)  # −g, [count]
    if lower_bound is None:
        return torch.log(torch.expm1(target))  # softplus(dt_bias) = −g
    return torch.logit(target / -lower_bound)  # lower_bound · σ(dt_bias) = g


class ShortConv(nn.Module):
    """The weight ``[channels, kernel_size]`` of a depthwise causal conv (followed by SiLU in the layer, which runs
    its q, k and v convolutions as one: :meth:`_GatedMixer.short_convs`)."""

    def __init__(self, channels: int, kernel_size: int = 4):
        super().__init__()
        bound = 1 / math.sqrt(kernel_size)
        self.weight = no_weight_decay(nn.Parameter(torch.empty(channels, kernel_size).uniform_(-bound, bound)))


class _GatedMixer(nn.Module):
    """Shared body of the three layers; subclasses define the forget gate and which ops mix the tokens.

    d_model, n_heads, head_dim (K = V); conv_size (4); output_gate "full" (K3: d → H·V) or "low_rank" (d → V →
    H·V); gate_bias: the low-rank gate's second map has a bias (fla's layer) or not (Kimi Linear's checkpoints);
    norm_eps: ε of the per-head output RMSNorm; mode "auto" | "chunk" | "recurrent"; chunk_size (a positive int;
    KDA: 16, 32 or 64, the kernels' tiles; default ``CHUNK_SIZE``); allow_neg_eigval (β ∈ (0, 2)).
    """

    uses_beta = True

    def __init__(self, d_model: int, n_heads: int, head_dim: int, conv_size: int = 4, output_gate: str = "full",
                 norm_eps: float = NORM_EPS, mode: str = "auto", chunk_size: int = CHUNK_SIZE,
                 allow_neg_eigval: bool = False, gate_bias: bool = True):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("head_dim", head_dim),
                            ("conv_size", conv_size), ("chunk_size", chunk_size)):
            if not is_number(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if output_gate not in OUTPUT_GATES:
            raise ValueError(f"output_gate must be one of {OUTPUT_GATES}, got {output_gate!r}")
        self.d_model, self.n_heads, self.head_dim, self.conv_size = d_model, n_heads, head_dim, conv_size
        self.mode, self.chunk_size = mode, chunk_size
        self.norm_eps, self.allow_neg_eigval = norm_eps, allow_neg_eigval
        width = n_heads * head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, width, bias=False) for _ in range(3))
        self.q_conv, self.k_conv, self.v_conv = (ShortConv(width, conv_size) for _ in range(3))
        self.b_proj = nn.Linear(d_model, n_heads, bias=False) if self.uses_beta else None
        if output_gate == "full":
            self.gate_proj = nn.Linear(d_model, width, bias=False)
        else:
            self.gate_proj = nn.Sequential(nn.Linear(d_model, head_dim, bias=False),
                                           nn.Linear(head_dim, width, bias=gate_bias))
            if gate_bias:
                no_weight_decay(self.gate_proj[1].bias)
        self.o_norm_weight = no_weight_decay(nn.Parameter(torch.ones(head_dim)))
        self.o_proj = nn.Linear(width, d_model, bias=False)
        residual_output(self.o_proj.weight)

    @classmethod
    def from_config(cls, cfg, **overrides):
        """The layer a :class:`k3course.config.K3Config` describes (its kda_* fields); ``overrides`` win."""
        sizes = dict(d_model=cfg.d_model, n_heads=cfg.kda_n_heads, head_dim=cfg.kda_head_dim,
                     conv_size=cfg.kda_conv_size, output_gate=cfg.kda_output_gate, gate_bias=cfg.kda_gate_bias,
                     norm_eps=cfg.kda_norm_eps, **cls._config_fields(cfg))
        return cls(**{**sizes, **overrides})

    @staticmethod
    def _config_fields(cfg) -> dict:
        return {}

    def new_cache(self, batch: int, max_len: int | None = None, device=None, dtype=None) -> KDACache:
        """An empty cache for ``batch`` sequences (zero conv tails; a zero state in fp32, or fp64 for fp64
        activations). ``max_len`` is accepted for the common layer interface and unused: the cache does not grow.
        dtype: the activations' (default: the layer's parameters')."""
        if not is_number(batch) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        weight = self.q_proj.weight
        device, dtype = device or weight.device, dtype or weight.dtype
        width, tail = self.n_heads * self.head_dim, self.conv_size - 1
        conv = lambda: torch.zeros(batch, tail, width, device=device, dtype=dtype)
        state = torch.zeros(batch, self.n_heads, self.head_dim, self.head_dim, device=device,
                            dtype=torch.promote_types(dtype, torch.float32))
        return KDACache(conv(), conv(), conv(), state)

    def short_convs(self, x, cache: KDACache | None):
        """q, k, v = SiLU(ShortConv(x W)) of the three maps at once: one product with W = [W_q; W_k; W_v] and one
        depthwise convolution over their 3·H·D channels. x ``[B, T, d]`` -> ((q, k, v) ``[B, T, H·D]`` each,
        their new conv tails ``[B, W − 1, H·D]`` each)."""
        width = self.n_heads * self.head_dim
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])  # [3·H·D, d]
        conv_weight = torch.cat([self.q_conv.weight, self.k_conv.weight, self.v_conv.weight])  # [3·H·D, W]
        tails = None if cache is None else torch.cat([cache.conv_q, cache.conv_k, cache.conv_v], dim=-1)
        y, tails = part("short_conv", short_conv)(F.linear(x, weight), conv_weight, tails)  # a learner's, if held
        return F.silu(y).split(width, dim=-1), tails.split(width, dim=-1)

    def _heads(self, x):
        return x.unflatten(-1, (self.n_heads, self.head_dim))  # [B, T, H·D] -> [B, T, H, D]

    def log_decay(self, x):
        raise NotImplementedError

    def starting_decays(self) -> torch.Tensor:
        """−g ``[H, K]`` at a zero gate input (z = 0, W_a x = 0) with the layer's gate parameters: the decay rates
        each head's channels start from (a per-head gate repeats its value over the K channels)."""
        raise NotImplementedError

    def mix(self, q, k, v, g, beta, initial_state, chunked: bool):
        """The one place the layer calls its op: ``(o [B, T, H, V], final_state [B, H, K, V] fp32 or fp64)``."""
        raise NotImplementedError

    def output_gate(self, x):
        """σ(gate(x)) [B, T, H·V]: the sigmoid output gate (full rank, or low rank with or without a bias)."""
        return torch.sigmoid(self.gate_proj(x))

    def uses_chunked_op(self, n_tokens: int) -> bool:
        """The path rule: chunked in training or for more than ``chunk_size`` tokens (mode "auto")."""
        if self.mode != "auto":
            return self.mode == "chunk"
        return self.training or n_tokens > self.chunk_size

    def _check_inputs(self, x, cache: KDACache | None) -> None:
        """Shapes, dtypes and the cache's batch: metadata only, no host read."""
        check_mixer_input(x, self.d_model)
        if cache is None:
            return
        if not isinstance(cache, KDACache):
            raise TypeError(f"cache must be a KDACache (from new_cache) or None, got {type(cache).__name__}")
        want = (x.shape[0], self.n_heads, self.head_dim, self.head_dim)
        if tuple(cache.state.shape) != want or cache.conv_q.shape[1] != self.conv_size - 1:
            raise ValueError(f"cache does not match this layer and batch: expected state {list(want)} "
                             f"(B = {x.shape[0]}), got {list(cache.state.shape)}")
        state_dtype = torch.promote_types(x.dtype, torch.float32)
        if cache.state.dtype != state_dtype or cache.conv_q.dtype != x.dtype:
            raise ValueError(f"cache has conv tails in {cache.conv_q.dtype} and state in {cache.state.dtype}; "
                             f"expected {x.dtype} (the dtype of x) and {state_dtype}")

    def forward(self, x, cache: KDACache | None = None):
        """x ``[B, T, d_model]`` -> ``(y [B, T, d_model], KDACache)``; a given ``cache`` continues its sequences
        and is updated in place."""
        self._check_inputs(x, cache)
        (q, k, v), (conv_q, conv_k, conv_v) = self.short_convs(x, cache)
        q, k = F.normalize(self._heads(q), dim=-1), F.normalize(self._heads(k), dim=-1)
        beta = None
        if self.uses_beta:
            beta = torch.sigmoid(self.b_proj(x))  # [B, T, H]
            if self.allow_neg_eigval:
                beta = 2 * beta  # β ∈ (0, 2): I − β k kᵀ may then flip the sign along k
        o, state = self.mix(q, k, self._heads(v), self.log_decay(x), beta,
                            None if cache is None else cache.state, self.uses_chunked_op(x.shape[1]))
        o = rms_norm(o, self.o_norm_weight, self.norm_eps).flatten(-2)  # [B, T, H·V]
        y = self.o_proj(self.output_gate(x) * o)
        if cache is None:
            return y, KDACache(conv_q, conv_k, conv_v, state, x.shape[1])
        cache.conv_q, cache.conv_k, cache.conv_v, cache.state = conv_q, conv_k, conv_v, state
        cache.length += x.shape[1]
        return y, cache


class KimiDeltaAttention(_GatedMixer):
    """KDA layer: channel-wise forget gate from a low-rank projection (d -> head_dim -> H·K) plus a bias.

    ``lower_bound=-5.0`` is K3's bounded gate g = −5·σ(e^{A_log}(z + dt_bias)); ``lower_bound=None`` is
    Kimi Linear's g = −e^{A_log}·softplus(z + dt_bias). The defaults are K3's (bounded gate, full-rank output
    gate); Kimi Linear is ``lower_bound=None, output_gate="low_rank"``. The starting decays (−g at z = 0) are
    spread geometrically from 0.01 to 0.5 over all H·K channels in order (:func:`initial_dt_bias`): head 0 the
    slowest, the last the fastest (chapter 12's controlled recall runs lay them out other ways:
    :func:`k3course.lessons.recall.decay_layout`). Other options: see the shared body.
    ``kernels``: the backend (:func:`k3course.kernels.kernel_backend`; None: ``K3COURSE_KERNELS``, default "auto"),
    chosen here once. On CUDA (or with "triton") the op is chapter 08's Triton kernels, on the same path (``mode``)
    with the same ``chunk_size`` and ``lower_bound``: the chunk kernels, or the fused recurrent kernel (decoding).
    chunk_size must be 16, 32 or 64 on every device (the kernels' tiles).
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, lower_bound: float | None = KDA_LOWER_BOUND,
                 kernels: str | None = None, **kwargs):
        super().__init__(d_model, n_heads, head_dim, **kwargs)
        check_kda_chunk_size(self.chunk_size)
        from k3course.kernels import kernel_backend  # imported here: the attention ops do not depend on the kernels

        self.kernels = kernel_backend(kernels)
        if lower_bound is not None and not lower_bound < 0:
            raise ValueError(f"lower_bound must be None or a negative number, got {lower_bound!r}")
        self.lower_bound = lower_bound
        self.f_proj = nn.Sequential(nn.Linear(d_model, head_dim, bias=False),
                                    nn.Linear(head_dim, n_heads * head_dim, bias=False))
        for weight in (self.f_proj[0].weight, self.f_proj[1].weight):
            forget_gate(weight)
        self.A_log = forget_gate(no_weight_decay(nn.Parameter(torch.zeros(n_heads))))
        dt_bias = initial_dt_bias(n_heads * head_dim, lower_bound).view(n_heads, head_dim)
        self.dt_bias = forget_gate(no_weight_decay(nn.Parameter(dt_bias)))

    @staticmethod
    def _config_fields(cfg) -> dict:
        return dict(lower_bound=cfg.kda_lower_bound)

    def log_decay(self, x):
        gate = part("kda_gate", kda_gate)  # a learner's, while k3course.parts holds one
        return gate(self._heads(self.f_proj(x)), self.A_log, self.dt_bias, self.lower_bound)

    @torch.no_grad()
    def starting_decays(self) -> torch.Tensor:
        return -kda_gate(torch.zeros_like(self.dt_bias), self.A_log, self.dt_bias, self.lower_bound)

    def mix(self, q, k, v, g, beta, initial_state, chunked: bool):
        from k3course.kernels import use_triton  # imported here: the attention ops do not depend on the kernels

        if chunked and is_replaced("kda_chunk"):  # a learner's chunked op (chapter 08), while k3course.parts holds one
            return part("kda_chunk", kda_chunk)(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                                chunk_size=self.chunk_size, lower_bound=self.lower_bound,
                                                allow_neg_eigval=self.allow_neg_eigval)
        if use_triton(q.device, self.kernels) and not self.allow_neg_eigval:  # the chapter 08 kernels
            from k3course.kernels.kda import kda_triton

            return kda_triton(q, k, v, g, beta, initial_state, chunked=chunked, chunk_size=self.chunk_size,
                              lower_bound=self.lower_bound)
        op = kda_chunk if chunked else kda_recurrent
        # a bounded gate (K3) lets the chunked path take its fast sub-chunk form (lesson 07)
        extra = dict(chunk_size=self.chunk_size, lower_bound=self.lower_bound) if chunked else {}
        return op(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                  allow_neg_eigval=self.allow_neg_eigval, **extra)


class GatedDeltaNet(_GatedMixer):
    """GDN layer: one forget rate per head, g = −e^{A_log}·softplus(W_a x + dt_bias) (Mamba2-style)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, **kwargs):
        super().__init__(d_model, n_heads, head_dim, **kwargs)
        self.a_proj = nn.Linear(d_model, n_heads, bias=False)
        forget_gate(self.a_proj.weight)
        self.A_log = forget_gate(no_weight_decay(nn.Parameter(torch.zeros(n_heads))))
        self.dt_bias = forget_gate(no_weight_decay(nn.Parameter(initial_dt_bias(n_heads, None))))

    def log_decay(self, x):
        return gdn_gate(self.a_proj(x), self.A_log, self.dt_bias)  # [B, T, H]

    @torch.no_grad()
    def starting_decays(self) -> torch.Tensor:
        return -gdn_gate(torch.zeros_like(self.dt_bias), self.A_log, self.dt_bias)[:, None].repeat(1, self.head_dim)

    def mix(self, q, k, v, g, beta, initial_state, chunked: bool):
        op = gdn_chunk if chunked else gdn_recurrent
        extra = dict(chunk_size=self.chunk_size) if chunked else {}
        return op(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                  allow_neg_eigval=self.allow_neg_eigval, **extra)


class DecayedLinearAttention(GatedDeltaNet):
    """Linear attention with a scalar forget gate per head and no delta rule: S_t = α_t S_{t-1} + k_t v_tᵀ.

    The same layer as :class:`GatedDeltaNet` minus β (the baseline of the recall comparison).
    """

    uses_beta = False

    def mix(self, q, k, v, g, beta, initial_state, chunked: bool):
        op = gla_chunk if chunked else gla_recurrent
        extra = dict(chunk_size=self.chunk_size) if chunked else {}
        return op(q, k, v, g, initial_state=initial_state, output_final_state=True, **extra)
