"""Gated MLA's prefill attention as FlashAttention-style Triton kernels (lesson 09's Triton rung).

Per head h, query t (at absolute position start + t) and key s (S = start + T keys, a cache prefix first):

    x[t, s] = scale · (q_nope[t]·k_nope[s] + q_rope[t]·k_rope[s])     (k_rope: one per token, shared by the heads)
    p[t, s] = softmax_s x[t, s] over s ≤ start + t,    o[t] = Σ_s p[t, s] v[s]

K3's query-key head is 192 wide (128 NoPE + 64 rope) and its value head 128: the two score parts are two
products of power-of-two tiles, so no lane is padded and the shared rope key is read once per head, never
copied per head. The [T, S] score matrix is never stored:

Forward (``_forward_kernel``): one program per (query block of BM rows, batch·head) walks the key blocks of BN
keys up to its causal limit, keeping for each row the running max m, the running sum l = Σ e^{x − m} and the
accumulator acc = Σ e^{x − m} v; a new block with max m' rescales both by e^{m − m'} (online softmax):

    m' = max(m, max_s x),   l ← e^{m − m'} l + Σ_s e^{x − m'},   acc ← e^{m − m'} acc + e^{x − m'} V_blk

then o = acc / l and the log-sum-exp L = m + log l (all a backward needs of the softmax).

Backward (FA-2): P is recomputed from the saved L, p = e^{x − L}; with D[t] = Σ_v dO[t] ⊙ O[t] (= Σ_s p dP):

    dV = Pᵀ dO,   dP = dO Vᵀ,   dX = P ⊙ (dP − D),   dQ = scale · dX K,   dK = scale · dXᵀ Q

``_key_grad_kernel``: one program per (key block, batch·head) owns dK_nope, dV and this head's share of dk_rope,
walking the query blocks that see its keys; ``_query_grad_kernel``: one program per (query block, batch·head)
owns dQ, walking the key blocks. No atomics: the heads' shares of the shared rope key's gradient are summed by
the caller. Everything accumulates in fp32; outputs and gradients have the inputs' dtype (L is fp32).
The output gate σ(W_G x) is applied beside the kernel by the layer (``k3course.layers.mla.output_gate``).
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.autograd.function import once_differentiable  # noqa: E402

from k3course.kernels.chunk_tiles import block_width, dot_fp32, low_precision, tile_offsets  # noqa: E402

ATTENTION_STAGES = 2  # software-pipelining depth on a GPU: shared memory stays under sm_90's 227 KB in fp32


@triton.jit
def _tile(ptr, stride_b, stride_t, stride_h, b, h, rows, n_rows, cols, width):
    """Load the tile rows × cols of an input [B, ·, H, width] (last axis contiguous, the others at the strides
    given; stride_h = 0 for a tensor without a head axis) for batch b (int64), head h, in the input's dtype;
    rows past n_rows and columns past width read 0."""
    offsets = b * stride_b + rows[:, None].to(tl.int64) * stride_t + h * stride_h + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < width)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _store_tile(ptr, tile, b, h, rows, n_rows, H, cols, width):
    """Store ``tile`` at rows × cols of a contiguous [B, n_rows, H, width] output, offsets in int64 (b is): at
    K3's size (T = 1M, H = 96, v = 128) they pass 2^31."""
    offsets, mask = tile_offsets(b, h, n_rows, H, rows, cols, width)
    tl.store(ptr + offsets, tile.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_contiguous(ptr, b, h, rows, n_rows, H, cols, width):
    """Load rows × cols of a contiguous [B, n_rows, H, width] tensor (the upstream gradient), int64 offsets."""
    offsets, mask = tile_offsets(b, h, n_rows, H, rows, cols, width)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _scores(q_nope, q_rope, k_nope, k_rope, scale, q_rows, k_rows, S, start, LOW_PRECISION: tl.constexpr):
    """x = scale (q_nope k_nopeᵀ + q_rope k_ropeᵀ) [BM, BN], −inf where key s is not visible to query t
    (s > start + t, or s past the S keys)."""
    x = (dot_fp32(q_nope, tl.trans(k_nope), LOW_PRECISION) + dot_fp32(q_rope, tl.trans(k_rope), LOW_PRECISION)) * scale
    visible = (k_rows[None, :] <= start + q_rows[:, None]) & (k_rows[None, :] < S)
    return tl.where(visible, x, float("-inf"))


@triton.jit
def _program_tiles(nope_ptr, rope_ptr, sn_b, sn_t, sn_h, sr_b, sr_t, sr_h, n_rows, H, N, E,
                   BLOCK: tl.constexpr, BDN: tl.constexpr, BDE: tl.constexpr):
    """What a program (row block, batch·head) starts from: its block index, bh (int64), batch b, head h, its
    BLOCK rows, and the NoPE [BLOCK, BDN] and rope [BLOCK, BDE] tiles of those rows (the queries, or the keys
    with sr_h = 0: one rope key per token, shared by the heads)."""
    block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = block * BLOCK + tl.arange(0, BLOCK)
    nope_tile = _tile(nope_ptr, sn_b, sn_t, sn_h, b, h, rows, n_rows, tl.arange(0, BDN), N)
    rope_tile = _tile(rope_ptr, sr_b, sr_t, sr_h, b, h, rows, n_rows, tl.arange(0, BDE), E)
    return block, bh, b, h, rows, nope_tile, rope_tile


@triton.jit
def _forward_kernel(qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, o_ptr, lse_ptr, scale, T, S, H, N, E, V, start,
                    sqn_b, sqn_t, sqn_h, sqr_b, sqr_t, sqr_h, skn_b, skn_t, skn_h, skr_b, skr_t, sv_b, sv_t, sv_h,
                    BM: tl.constexpr, BN: tl.constexpr, BDN: tl.constexpr, BDE: tl.constexpr, BDV: tl.constexpr,
                    LOW_PRECISION: tl.constexpr):
    """One program per (query block, batch·head): o [BM, V] and L [BM] of its rows by the online softmax."""
    m_block, bh, b, h, q_rows, q_nope, q_rope = _program_tiles(qn_ptr, qr_ptr, sqn_b, sqn_t, sqn_h, sqr_b, sqr_t,
                                                                sqr_h, T, H, N, E, BM, BDN, BDE)
    nope, rope, vals = tl.arange(0, BDN), tl.arange(0, BDE), tl.arange(0, BDV)
    row_max = tl.full([BM], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BDV], dtype=tl.float32)
    key_end = tl.minimum(S, start + (m_block + 1) * BM)  # the last row of the block sees keys < key_end
    for n0 in range(0, key_end, BN):
        k_rows = n0 + tl.arange(0, BN)
        k_nope = _tile(kn_ptr, skn_b, skn_t, skn_h, b, h, k_rows, S, nope, N)
        k_rope = _tile(kr_ptr, skr_b, skr_t, 0, b, h, k_rows, S, rope, E)
        x = _scores(q_nope, q_rope, k_nope, k_rope, scale, q_rows, k_rows, S, start, LOW_PRECISION)
        new_max = tl.maximum(row_max, tl.max(x, axis=1))  # finite: key 0 is visible to every row
        p = tl.exp(x - new_max[:, None])
        rescale = tl.exp(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        values = _tile(v_ptr, sv_b, sv_t, sv_h, b, h, k_rows, S, vals, V)
        acc = acc * rescale[:, None] + dot_fp32(p, values, LOW_PRECISION)
        row_max = new_max
    _store_tile(o_ptr, acc / row_sum[:, None], b, h, q_rows, T, H, vals, V)
    tl.store(lse_ptr + bh * T + q_rows, row_max + tl.log(row_sum), mask=q_rows < T)


@triton.jit
def _key_grad_kernel(qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dkn_ptr, dkr_ptr, dv_ptr,
                     scale, T, S, H, N, E, V, start,
                     sqn_b, sqn_t, sqn_h, sqr_b, sqr_t, sqr_h, skn_b, skn_t, skn_h, skr_b, skr_t, sv_b, sv_t, sv_h,
                     BM: tl.constexpr, BN: tl.constexpr, BDN: tl.constexpr, BDE: tl.constexpr, BDV: tl.constexpr,
                     LOW_PRECISION: tl.constexpr):
    """One program per (key block, batch·head): dK_nope, this head's dk_rope share and dV of its BN keys,
    Σ over the query blocks that see them of dV += Pᵀ dO, dK += scale · dXᵀ Q."""
    n_block, bh, b, h, k_rows, k_nope, k_rope = _program_tiles(kn_ptr, kr_ptr, skn_b, skn_t, skn_h, skr_b, skr_t,
                                                                0, S, H, N, E, BN, BDN, BDE)
    nope, rope, vals = tl.arange(0, BDN), tl.arange(0, BDE), tl.arange(0, BDV)
    values = _tile(v_ptr, sv_b, sv_t, sv_h, b, h, k_rows, S, vals, V)
    grad_k_nope = tl.zeros([BN, BDN], dtype=tl.float32)
    grad_k_rope = tl.zeros([BN, BDE], dtype=tl.float32)
    grad_v = tl.zeros([BN, BDV], dtype=tl.float32)
    first_query = tl.maximum(n_block * BN - start, 0) // BM * BM  # query t sees key s from t = s − start on
    for m0 in range(first_query, T, BM):
        q_rows = m0 + tl.arange(0, BM)
        q_nope = _tile(qn_ptr, sqn_b, sqn_t, sqn_h, b, h, q_rows, T, nope, N)
        q_rope = _tile(qr_ptr, sqr_b, sqr_t, sqr_h, b, h, q_rows, T, rope, E)
        grad_o = _load_contiguous(do_ptr, b, h, q_rows, T, H, vals, V)
        lse = tl.load(lse_ptr + bh * T + q_rows, mask=q_rows < T, other=float("inf"))  # rows past T: p = 0
        delta = tl.load(delta_ptr + bh * T + q_rows, mask=q_rows < T, other=0.0)
        p = tl.exp(_scores(q_nope, q_rope, k_nope, k_rope, scale, q_rows, k_rows, S, start, LOW_PRECISION)
                   - lse[:, None])                                                     # [BM, BN]
        grad_v += dot_fp32(tl.trans(p), grad_o, LOW_PRECISION)
        grad_x = p * (dot_fp32(grad_o, tl.trans(values), LOW_PRECISION) - delta[:, None]) * scale
        grad_k_nope += dot_fp32(tl.trans(grad_x), q_nope, LOW_PRECISION)
        grad_k_rope += dot_fp32(tl.trans(grad_x), q_rope, LOW_PRECISION)
    _store_tile(dkn_ptr, grad_k_nope, b, h, k_rows, S, H, nope, N)
    _store_tile(dkr_ptr, grad_k_rope, b, h, k_rows, S, H, rope, E)
    _store_tile(dv_ptr, grad_v, b, h, k_rows, S, H, vals, V)


@triton.jit
def _query_grad_kernel(qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dqn_ptr, dqr_ptr,
                       scale, T, S, H, N, E, V, start,
                       sqn_b, sqn_t, sqn_h, sqr_b, sqr_t, sqr_h, skn_b, skn_t, skn_h, skr_b, skr_t, sv_b, sv_t, sv_h,
                       BM: tl.constexpr, BN: tl.constexpr, BDN: tl.constexpr, BDE: tl.constexpr,
                       BDV: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """One program per (query block, batch·head): dQ = scale · Σ over the visible key blocks of dX K."""
    m_block, bh, b, h, q_rows, q_nope, q_rope = _program_tiles(qn_ptr, qr_ptr, sqn_b, sqn_t, sqn_h, sqr_b, sqr_t,
                                                                sqr_h, T, H, N, E, BM, BDN, BDE)
    nope, rope, vals = tl.arange(0, BDN), tl.arange(0, BDE), tl.arange(0, BDV)
    grad_o = _load_contiguous(do_ptr, b, h, q_rows, T, H, vals, V)
    lse = tl.load(lse_ptr + bh * T + q_rows, mask=q_rows < T, other=float("inf"))
    delta = tl.load(delta_ptr + bh * T + q_rows, mask=q_rows < T, other=0.0)
    grad_q_nope = tl.zeros([BM, BDN], dtype=tl.float32)
    grad_q_rope = tl.zeros([BM, BDE], dtype=tl.float32)
    key_end = tl.minimum(S, start + (m_block + 1) * BM)
    for n0 in range(0, key_end, BN):
        k_rows = n0 + tl.arange(0, BN)
        k_nope = _tile(kn_ptr, skn_b, skn_t, skn_h, b, h, k_rows, S, nope, N)
        k_rope = _tile(kr_ptr, skr_b, skr_t, 0, b, h, k_rows, S, rope, E)
        values = _tile(v_ptr, sv_b, sv_t, sv_h, b, h, k_rows, S, vals, V)
        p = tl.exp(_scores(q_nope, q_rope, k_nope, k_rope, scale, q_rows, k_rows, S, start, LOW_PRECISION)
                   - lse[:, None])
        grad_x = p * (dot_fp32(grad_o, tl.trans(values), LOW_PRECISION) - delta[:, None]) * scale
        grad_q_nope += dot_fp32(grad_x, k_nope, LOW_PRECISION)
        grad_q_rope += dot_fp32(grad_x, k_rope, LOW_PRECISION)
    _store_tile(dqn_ptr, grad_q_nope, b, h, q_rows, T, H, nope, N)
    _store_tile(dqr_ptr, grad_q_rope, b, h, q_rows, T, H, rope, E)


def _check_inputs(q_nope, q_rope, k_nope, k_rope, values, start) -> None:
    """Shapes, devices, dtypes and ``start`` (metadata only, no host read), each error naming its argument."""
    if q_nope.dim() != 4:
        raise ValueError(f"q_nope must be [B, T, H, n], got shape {tuple(q_nope.shape)}")
    B, T, H, _ = q_nope.shape
    S = k_nope.shape[1] if k_nope.dim() == 4 else -1
    expected = {"q_rope": (q_rope, (B, T, H)), "k_nope": (k_nope, (B, S, H)), "values": (values, (B, S, H))}
    for name, (x, leading) in expected.items():
        if x.dim() != 4 or tuple(x.shape[:3]) != leading:
            raise ValueError(f"{name} must be [B, ·, H, ·] with B = {B}, H = {H} (and k_nope's S for the keys), "
                             f"got shape {tuple(x.shape)}")
    if k_nope.shape[-1] != q_nope.shape[-1]:
        raise ValueError(f"k_nope must be as wide as q_nope ({q_nope.shape[-1]}), got {k_nope.shape[-1]}")
    if tuple(k_rope.shape) != (B, S, q_rope.shape[-1]):
        raise ValueError(f"k_rope must be [B, S, e] = {(B, S, q_rope.shape[-1])} (shared by the heads), "
                         f"got shape {tuple(k_rope.shape)}")
    if max(q_nope.shape[-1], q_rope.shape[-1], values.shape[-1]) > 256:
        raise ValueError(f"head widths must be ≤ 256 for these kernels, got n = {q_nope.shape[-1]}, "
                         f"e = {q_rope.shape[-1]}, v = {values.shape[-1]}")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0 or start + T != S:
        raise ValueError(f"start must be the int number of cached keys, S − T = {S - T}, got {start!r}")
    tensors = (q_nope, q_rope, k_nope, k_rope, values)
    if len({x.device for x in tensors}) != 1 or len({x.dtype for x in tensors}) != 1:
        raise ValueError("q_nope, q_rope, k_nope, k_rope and values must share one device and one dtype, got "
                         f"{[str(x.dtype) for x in tensors]} on {sorted({str(x.device) for x in tensors})}")
    if TRITON_MODE == "interpreter" and q_nope.dtype != torch.float32:
        raise TypeError(f"q_nope: the Triton interpreter needs fp32 inputs (bf16 is wrong there), got {q_nope.dtype}")


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with its last axis contiguous (the kernels take strides for the others): x itself when it already is."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _launch_options(q_nope, q_rope, values) -> dict:
    """Tile sizes: 16 × 16 under the interpreter (fast on a CPU), 64 × 64 on a GPU in bf16, 32 × 32 in fp32
    (fp32 tiles take twice the shared memory); the head widths rounded up to powers of two."""
    native_block = 64 if low_precision(q_nope) else 32
    block = native_block if TRITON_MODE == "native" else 16
    return dict(BM=block, BN=block, BDN=block_width(q_nope.shape[-1]), BDE=block_width(q_rope.shape[-1]),
                BDV=block_width(values.shape[-1]), LOW_PRECISION=low_precision(q_nope),
                **({"num_stages": ATTENTION_STAGES} if TRITON_MODE == "native" else {}))


def _strides(q_nope, q_rope, k_nope, k_rope, values) -> tuple[int, ...]:
    """The (batch, time, head) strides of each input in kernel-argument order (k_rope has no head axis)."""
    return (*q_nope.stride()[:3], *q_rope.stride()[:3], *k_nope.stride()[:3], *k_rope.stride()[:2],
            *values.stride()[:3])


def flash_mla_forward(q_nope, q_rope, k_nope, k_rope, values, scale: float, start: int = 0):
    """The forward kernel alone: (o [B, T, H, v] in the inputs' dtype, L [B, H, T] fp32 log-sum-exp of each
    row's scaled scores). Shapes and the maths as :func:`flash_mla_attention`; no autograd."""
    _check_inputs(q_nope, q_rope, k_nope, k_rope, values, start)
    q_nope, q_rope, k_nope, k_rope, values = map(_rows_contiguous, (q_nope, q_rope, k_nope, k_rope, values))
    B, T, H, N = q_nope.shape
    S, E, V = k_nope.shape[1], q_rope.shape[-1], values.shape[-1]
    out = torch.empty(B, T, H, V, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q_nope.device)
    options = _launch_options(q_nope, q_rope, values)
    _forward_kernel[(triton.cdiv(T, options["BM"]), B * H)](
        q_nope, q_rope, k_nope, k_rope, values, out, lse, float(scale), T, S, H, N, E, V, start,
        *_strides(q_nope, q_rope, k_nope, k_rope, values), **options)
    return out, lse


def flash_mla_backward(q_nope, q_rope, k_nope, k_rope, values, out, lse, grad_out, scale: float, start: int = 0):
    """The gradients of :func:`flash_mla_attention` from its inputs, its output, L and dO: (dq_nope, dq_rope,
    dk_nope, dk_rope, dvalues) in the inputs' dtype, dk_rope [B, S, e] summed over the heads."""
    q_nope, q_rope, k_nope, k_rope, values = map(_rows_contiguous, (q_nope, q_rope, k_nope, k_rope, values))
    B, T, H, N = q_nope.shape
    S, E, V = k_nope.shape[1], q_rope.shape[-1], values.shape[-1]
    grad_out = grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # D = Σ_v dO ⊙ O [B, H, T]
    fp32 = dict(dtype=torch.float32, device=q_nope.device)
    grad_q_nope, grad_q_rope = torch.empty(B, T, H, N, **fp32), torch.empty(B, T, H, E, **fp32)
    grad_k_nope, grad_k_rope_heads = torch.empty(B, S, H, N, **fp32), torch.empty(B, S, H, E, **fp32)
    grad_values = torch.empty(B, S, H, V, **fp32)
    options = _launch_options(q_nope, q_rope, values)
    inputs = (q_nope, q_rope, k_nope, k_rope, values, grad_out, lse, delta)
    sizes = (float(scale), T, S, H, N, E, V, start, *_strides(q_nope, q_rope, k_nope, k_rope, values))
    _key_grad_kernel[(triton.cdiv(S, options["BN"]), B * H)](
        *inputs, grad_k_nope, grad_k_rope_heads, grad_values, *sizes, **options)
    _query_grad_kernel[(triton.cdiv(T, options["BM"]), B * H)](*inputs, grad_q_nope, grad_q_rope, *sizes, **options)
    grads = (grad_q_nope, grad_q_rope, grad_k_nope, grad_k_rope_heads.sum(2), grad_values)
    return tuple(grad.to(q_nope.dtype) for grad in grads)


class _FlashMLAFunction(torch.autograd.Function):
    """Forward and backward as Triton kernels; the forward saves its inputs, o and L (never the scores)."""

    @staticmethod
    def forward(ctx, q_nope, q_rope, k_nope, k_rope, values, scale, start):
        out, lse = flash_mla_forward(q_nope, q_rope, k_nope, k_rope, values, scale, start)
        ctx.save_for_backward(q_nope, q_rope, k_nope, k_rope, values, out, lse)
        ctx.scale, ctx.start = scale, start
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        grads = flash_mla_backward(*ctx.saved_tensors, grad_out, ctx.scale, ctx.start)
        return (*grads, None, None)


def flash_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                        values: torch.Tensor, scale: float, start: int = 0) -> torch.Tensor:
    """Causal MLA attention, o[t] = Σ_{s ≤ start + t} softmax_s(scale (q_nope·k_nope + q_rope·k_rope)) v[s], as
    Triton kernels that never store the [T, S] scores; differentiable (the FA-2 backward).

    q_nope [B, T, H, n], q_rope [B, T, H, e]; k_nope [B, S, H, n], k_rope [B, S, e] (shared by the heads),
    values [B, S, H, v], S = start + T (``start`` cached keys first); head widths ≤ 256, any strides with the
    last axis contiguous (else copied). Returns o [B, T, H, v] in the inputs' dtype — the arguments and result of
    ``k3course.layers.mla.attend_sdpa``. On a GPU natively; on a CPU under the Triton interpreter in fp32.
    """
    return _FlashMLAFunction.apply(q_nope, q_rope, k_nope, k_rope, values, float(scale), start)
