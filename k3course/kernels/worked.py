"""Worked examples for lesson 08: Triton kernels for problems *next to* the exercises', never the exercises' own.

The lesson reads these, and the exercises ask for their neighbours (the same idea on another problem):

- :func:`silu`               an elementwise map with a masked ragged end      (exercise: α·x + y)
- :func:`rms_norm_rows`      a row-wise reduction, rows read through a stride (exercises: L2 norm, softmax)
- :func:`matmul_nt`          C = A Bᵀ by tiles, an fp32 accumulator over K     (exercise: C = A B)
- :func:`scalar_gate_cumsum` the in-chunk cumulative sum of a scalar gate, GDN's [B, T, H]
                                                                               (exercise: KDA's [B, T, H, K])
- :func:`gdn_decode`         Gated DeltaNet's decode step, one decay per head  (exercise: KDA's per-channel decay)
- :func:`segment_sums`       each group's rows summed, group ends read on the device, empty groups zero
                                                                               (exercise: the MoE grouped GEMM)

Each is tested against torch (``tests/test_kernels_worked.py``); fp32 under the interpreter.
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _silu_kernel(x_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    start = tl.program_id(0) * BLOCK  # this program's first element
    index = start + tl.arange(0, BLOCK)
    inside = index < numel  # lanes past the end are switched off
    value = tl.load(x_ptr + index, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + index, (value * tl.sigmoid(value)).to(y_ptr.dtype.element_ty), mask=inside)


def silu(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """y = x · σ(x) elementwise (the experts' activation) for a 1-D x; one program per ``block`` elements."""
    if x.dim() != 1:
        raise ValueError(f"x must be 1-D, got shape {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty_like(x)
    _silu_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, y_ptr, row_stride, width, eps, BLOCK: tl.constexpr):
    channel = tl.arange(0, BLOCK)
    valid = channel < width
    row_start = tl.program_id(0) * row_stride  # rows may sit further apart than their width
    row = tl.load(x_ptr + row_start + channel, mask=valid, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + channel, mask=valid, other=0.0).to(tl.float32)
    mean_square = tl.sum(row * row, axis=0) / width  # padded lanes are 0: they add nothing
    normed = row * tl.rsqrt(mean_square + eps) * weight
    tl.store(y_ptr + tl.program_id(0) * width + channel, normed.to(y_ptr.dtype.element_ty), mask=valid)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y[i] = x[i] / sqrt(mean_j x[i, j]² + eps) ⊙ weight for x [N, D] whose rows are contiguous but may be strided
    (a slice of a wider tensor is read in place, not copied); weight [D]. One program per row; y is contiguous."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, D] with contiguous rows, got shape {tuple(x.shape)}, strides {x.stride()}")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"weight must be [D] = [{x.shape[1]}], got {tuple(weight.shape)}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, weight.contiguous(), y, x.stride(0), x.shape[1], eps,
                                        BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


@triton.jit
def _matmul_nt_kernel(a_ptr, b_ptr, c_ptr, M, N, depth, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    tile_m, tile_n = tl.program_id(0), tl.program_id(1)
    m = tile_m * BM + tl.arange(0, BM)  # rows of A and of C
    n = tile_n * BN + tl.arange(0, BN)  # rows of B, columns of C
    d = tl.arange(0, BD)
    total = tl.zeros([BM, BN], dtype=tl.float32)
    for d0 in range(0, depth, BD):
        a_tile = tl.load(a_ptr + m[:, None] * depth + (d0 + d)[None, :],
                         mask=(m[:, None] < M) & ((d0 + d)[None, :] < depth), other=0.0)  # [BM, BD]
        b_tile = tl.load(b_ptr + n[:, None] * depth + (d0 + d)[None, :],
                         mask=(n[:, None] < N) & ((d0 + d)[None, :] < depth), other=0.0)  # [BN, BD]: rows of B
        total += tl.dot(a_tile, tl.trans(b_tile), input_precision="ieee")
    tl.store(c_ptr + m[:, None] * N + n[None, :], total, mask=(m[:, None] < M) & (n[None, :] < N))


def matmul_nt(a: torch.Tensor, b: torch.Tensor, block: int = 16) -> torch.Tensor:
    """C = A Bᵀ for fp32 A [M, D], B [N, D] (the shape of attention's scores Q Kᵀ): program (i, j) computes C's
    tile (i, j), reading both operands row-major and walking D in steps of ``block``."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, D] and b [N, D] must agree on D, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.contiguous(), b.contiguous()
    c = torch.empty(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(a.shape[0], block), triton.cdiv(b.shape[0], block))
    _matmul_nt_kernel[grid](a, b, c, a.shape[0], b.shape[0], a.shape[1], BM=block, BN=block, BD=block)
    return c


@triton.jit
def _scalar_gate_cumsum_kernel(g_ptr, out_ptr, T, H, BT: tl.constexpr, BH: tl.constexpr):
    chunk, batch = tl.program_id(0), tl.program_id(1)
    time = chunk * BT + tl.arange(0, BT)  # [BT] this chunk's tokens
    head = tl.arange(0, BH)  # [BH] every head at once: the gate has one value per (token, head)
    where = (batch * T + time[:, None]) * H + head[None, :]  # [BT, BH] in the [B, T, H] layout
    inside = (time[:, None] < T) & (head[None, :] < H)
    gate = tl.load(g_ptr + where, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + where, tl.cumsum(gate, axis=0), mask=inside)


def scalar_gate_cumsum(g: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """Gated DeltaNet's in-chunk cumulative log-decay: G[b, t, h] = Σ_{s = cC}^{t} g[b, s, h], c = ⌊t / C⌋, for a
    scalar gate g [B, T, H] (one decay per head); fp32 [B, T, H]. One program per (chunk, batch), all heads."""
    if g.dim() != 3:
        raise ValueError(f"g must be [B, T, H], got shape {tuple(g.shape)}")
    g = g.contiguous()
    B, T, H = g.shape
    out = torch.empty(B, T, H, dtype=torch.float32, device=g.device)
    _scalar_gate_cumsum_kernel[(triton.cdiv(T, chunk_size), B)](g, out, T, H, BT=chunk_size,
                                                                BH=triton.next_power_of_2(H))
    return out


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, scale, T, H, K, V,
                       BK: tl.constexpr, BV: tl.constexpr):
    pair = tl.program_id(0)  # one (batch, head) pair: its whole [K, V] state
    batch, head = pair // H, pair % H
    d_k, d_v = tl.arange(0, BK), tl.arange(0, BV)
    in_k, in_v = d_k < K, d_v < V
    slot = pair * K * V + d_k[:, None] * V + d_v[None, :]
    memory = tl.load(state_ptr + slot, mask=in_k[:, None] & in_v[None, :], other=0.0)
    for t in range(T):
        token = (batch * T + t) * H + head
        query = tl.load(q_ptr + token * K + d_k, mask=in_k, other=0.0)
        key = tl.load(k_ptr + token * K + d_k, mask=in_k, other=0.0)
        value = tl.load(v_ptr + token * V + d_v, mask=in_v, other=0.0)
        decay = tl.exp(tl.load(g_ptr + token))  # one number for the whole head: the scalar gate
        rate = tl.load(beta_ptr + token)
        memory = memory * decay
        recalled = tl.sum(memory * key[:, None], axis=0)  # [BV] what the memory holds for this key
        memory = memory + rate * key[:, None] * (value - recalled)[None, :]
        tl.store(o_ptr + token * V + d_v, scale * tl.sum(memory * query[:, None], axis=0), mask=in_v)
    tl.store(state_ptr + slot, memory, mask=in_k[:, None] & in_v[None, :])


def gdn_decode(q, k, v, g, beta, state: torch.Tensor, scale: float | None = None):
    """Advance Gated DeltaNet by the T tokens given, updating the fp32 ``state`` [B, H, K, V] in place:

        S ← e^{g_t} S,   S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ,   o_t = scale · Sᵀ q_t,

    with one log-decay g_t per head (g [B, T, H]), where KDA has one per channel. q, k: [B, T, H, K]; v [B, T, H, V];
    beta [B, T, H]; fp32 inputs. One program per (batch, head). Returns (o [B, T, H, V], state).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    for name, x, shape in (("k", k, (B, T, H, K)), ("v", v, (B, T, H, V)), ("g", g, (B, T, H)),
                           ("beta", beta, (B, T, H)), ("state", state, (B, H, K, V))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise TypeError(f"state must be a contiguous fp32 tensor (updated in place), got {state.dtype}")
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    _gdn_decode_kernel[(B * H,)](q, k, v, g, beta, state, o, scale, T, H, K, V,
                                 BK=max(16, triton.next_power_of_2(K)), BV=max(16, triton.next_power_of_2(V)))
    return o, state


@triton.jit
def _segment_sum_kernel(x_ptr, ends_ptr, out_ptr, N, row_stride, BR: tl.constexpr, BN: tl.constexpr):
    group, col_block = tl.program_id(0), tl.program_id(1)
    first = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)  # the previous group's end: 0 before group 0
    stop = tl.load(ends_ptr + group)  # bounds read on the device: the host never learns the group sizes
    columns = col_block * BN + tl.arange(0, BN)
    in_n = columns < N
    total = tl.zeros([BN], dtype=tl.float32)
    for row0 in range(first, stop, BR):  # an empty group (first == stop) runs no step and stores zeros
        rows = row0 + tl.arange(0, BR)
        block = tl.load(x_ptr + rows[:, None].to(tl.int64) * row_stride + columns[None, :],
                        mask=(rows < stop)[:, None] & in_n[None, :], other=0.0)
        total += tl.sum(block.to(tl.float32), axis=0)
    tl.store(out_ptr + group * N + columns, total, mask=in_n)


def segment_sums(x_sorted: torch.Tensor, group_ends: torch.Tensor, block: int = 16) -> torch.Tensor:
    """out[e] = Σ_{r ∈ [ends[e−1], ends[e])} x_sorted[r]: the rows of each group summed, for rows sorted by group.

    x_sorted [M, N] (rows contiguous, possibly strided); group_ends [E] integer, non-decreasing, the end of each
    group's rows (ends[−1] = 0 before the first), read on the device only. One program per (group, ``block``
    columns) walks its group's rows; an empty group's row is zero. Returns fp32 [E, N].
    """
    if x_sorted.dim() != 2 or x_sorted.stride(1) != 1:
        raise ValueError(f"x_sorted must be [M, N] with contiguous rows, got shape {tuple(x_sorted.shape)}")
    if group_ends.dim() != 1 or group_ends.is_floating_point():
        raise ValueError(f"group_ends must be a 1-D integer tensor, got {group_ends.dtype} {tuple(group_ends.shape)}")
    E, N = group_ends.numel(), x_sorted.shape[1]
    out = torch.empty(E, N, dtype=torch.float32, device=x_sorted.device)
    _segment_sum_kernel[(E, triton.cdiv(N, block))](x_sorted, group_ends, out, N, x_sorted.stride(0), BR=block,
                                                     BN=block)
    return out
