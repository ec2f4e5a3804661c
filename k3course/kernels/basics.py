"""Triton from zero (chapter 08): four small kernels, each adding one idea.

- :func:`scale_add`        programs and blocks: program p owns elements [p·BLOCK, (p+1)·BLOCK); a mask guards
                           the ragged end (no bounds checks in Triton: an unmasked load past the end reads junk).
- :func:`l2norm_rows`      a row-wise reduction: one program per row, the row padded to a power of two.
- :func:`matmul`           ``tl.dot`` on tiles and a loop that carries state (the fp32 accumulator) over K.
- :func:`decayed_kk_tile`  one off-diagonal tile of KDA's intra-chunk product, normalised at a reference row
                           so that every exponent is ≤ 0 (the heart of ``kda_chunk._intra_chunk_kernel``).
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _scale_add_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # which block of the vector this program owns
    offsets = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] element indices
    mask = offsets < n  # the last block may run past the end
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, alpha * x + y, mask=mask)


def scale_add(x: torch.Tensor, y: torch.Tensor, alpha: float, block: int = 64) -> torch.Tensor:
    """out = alpha · x + y elementwise, for 1-D x and y of one length; one program per ``block`` elements."""
    if x.dim() != 1 or x.shape != y.shape:
        raise ValueError(f"x and y must be 1-D of one length, got {tuple(x.shape)} and {tuple(y.shape)}")
    out = torch.empty_like(x)
    _scale_add_kernel[(triton.cdiv(x.numel(), block),)](x, y, out, alpha, x.numel(), BLOCK=block)
    return out


@triton.jit
def _l2norm_rows_kernel(x_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    inv_norm = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) + eps)  # padded entries are 0: they add nothing
    tl.store(out_ptr + row * n_cols + cols, (x * inv_norm).to(out_ptr.dtype.element_ty), mask=mask)


def l2norm_rows(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y[i] = x[i] / sqrt(Σ_j x[i, j]² + eps) for x [N, D] (KDA's q and k normalisation); one program per row."""
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got shape {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _l2norm_rows_kernel[(x.shape[0],)](x, out, x.shape[1], eps, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)  # a 2-D grid: one [BM, BN] tile of C per program
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    depth = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)  # the state the loop carries
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rows[:, None] * K + (k0 + depth)[None, :],
                    mask=(rows[:, None] < M) & (k0 + depth[None, :] < K), other=0.0)  # [BM, BK]
        b = tl.load(b_ptr + (k0 + depth)[:, None] * N + cols[None, :],
                    mask=(k0 + depth[:, None] < K) & (cols[None, :] < N), other=0.0)  # [BK, BN]
        acc += tl.dot(a, b, input_precision="ieee")
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul(a: torch.Tensor, b: torch.Tensor, block: int = 16) -> torch.Tensor:
    """C = A B for fp32 A [M, K], B [K, N], tiled: program (i, j) computes C's tile (i, j), looping over K."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a [M, K] and b [K, N] must agree on K, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.contiguous(), b.contiguous()
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(M, block), triton.cdiv(N, block))
    _matmul_kernel[grid](a, b, c, M, N, K, BM=block, BN=block, BK=block)
    return c


@triton.jit
def _decayed_kk_tile_kernel(k_ptr, gc_ptr, out_ptr, row_start, col_start, K, BC: tl.constexpr, BK: tl.constexpr):
    local = tl.arange(0, BC)
    cols = tl.arange(0, BK)
    mask = cols[None, :] < K
    offs_r = (row_start + local)[:, None] * K + cols[None, :]
    offs_c = (col_start + local)[:, None] * K + cols[None, :]
    k_r = tl.load(k_ptr + offs_r, mask=mask, other=0.0)
    g_r = tl.load(gc_ptr + offs_r, mask=mask, other=0.0)
    k_c = tl.load(k_ptr + offs_c, mask=mask, other=0.0)
    g_c = tl.load(gc_ptr + offs_c, mask=mask, other=0.0)
    g_ref = tl.load(gc_ptr + row_start * K + cols, mask=cols < K, other=0.0)  # [BK] G at the tile's first row
    rows_scaled = k_r * tl.exp(g_r - g_ref[None, :])  # G_r ≤ G_ref: factors ≤ 1
    cols_scaled = k_c * tl.exp(g_ref[None, :] - g_c)  # G_ref ≤ G_c (columns come earlier): factors ≤ 1
    tile = tl.dot(rows_scaled, tl.trans(cols_scaled), input_precision="ieee")  # [BC, BC]
    tl.store(out_ptr + local[:, None] * BC + local[None, :], tile)


def decayed_kk_tile(k: torch.Tensor, gc: torch.Tensor, row_start: int, col_start: int, size: int = 16) -> torch.Tensor:
    """One tile of the intra-chunk product, for rows r and columns i of two sub-chunks of one head:

        tile[r, i] = Σ_d k[row_start + r, d] · k[col_start + i, d] · exp(G[row_start + r, d] − G[col_start + i, d])

    k, gc: fp32 [T, K] (gc the in-chunk cumulative log-decay, non-increasing along T within the chunk);
    the column block must end at or before the row block (col_start + size ≤ row_start). Computed as
    (k_r e^{G_r − G_n}) (k_i e^{G_n − G_i})ᵀ with n = row_start, so no factor exceeds 1. Returns [size, size].
    """
    if k.dim() != 2 or gc.shape != k.shape:
        raise ValueError(f"k and gc must both be [T, K], got {tuple(k.shape)} and {tuple(gc.shape)}")
    if size not in (16, 32, 64):
        raise ValueError(f"size must be 16, 32 or 64, got {size}")
    if not (0 <= col_start and col_start + size <= row_start and row_start + size <= k.shape[0]):
        raise ValueError(f"need 0 ≤ col_start, col_start + size ≤ row_start and row_start + size ≤ T = {k.shape[0]};"
                         f" got row_start={row_start}, col_start={col_start}, size={size}")
    k, gc = k.contiguous(), gc.contiguous()
    out = torch.empty(size, size, dtype=torch.float32, device=k.device)
    _decayed_kk_tile_kernel[(1,)](k, gc, out, row_start, col_start, k.shape[1], BC=size,
                                  BK=max(16, triton.next_power_of_2(k.shape[1])))
    return out
