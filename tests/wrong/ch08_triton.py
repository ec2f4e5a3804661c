"""Plausible wrong answers for chapter 08: Triton kernels with a Triton bug, and torch code where a kernel is asked.

The torch answers compute the right thing the wrong way (the check refuses torch math in a Triton exercise);
the kernels run under the interpreter on CPU, small shapes.
"""

import torch
import triton
import triton.language as tl

import k3course.kernels  # noqa: F401  (first: picks the interpreter on CPU before any @triton.jit)


def l2norm_in_torch(x):
    """The right values, written in torch instead of a kernel."""
    return x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()


@triton.jit
def _l2norm_eps_outside_kernel(x_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * n_cols + cols, x / (tl.sqrt(tl.sum(x * x, axis=0)) + eps), mask=mask)


def l2norm_eps_outside_sqrt(x):
    """x / (‖x‖ + eps): the same as the reference unless a row's norm is tiny."""
    y = torch.empty_like(x)
    _l2norm_eps_outside_kernel[(x.shape[0],)](x, y, x.shape[1], 1e-6, BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


@triton.jit
def _cumsum_never_resets_kernel(g_ptr, out_ptr, T, H, K, BT: tl.constexpr, BK: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    rows, cols = tl.arange(0, BT), tl.arange(0, BK)
    offsets = ((b * T + rows[:, None]) * H + h) * K + cols[None, :]
    mask = (rows[:, None] < T) & (cols[None, :] < K)
    tl.store(out_ptr + offsets, tl.cumsum(tl.load(g_ptr + offsets, mask=mask, other=0.0), axis=0), mask=mask)


def cumsum_one_chunk_for_all(g, chunk_size=64):
    """One program per (batch, head) over the whole sequence: the sum never restarts at a chunk boundary."""
    B, T, H, K = g.shape
    out = torch.empty(B, T, H, K, dtype=torch.float32)
    _cumsum_never_resets_kernel[(B * H,)](g.contiguous(), out, T, H, K, BT=triton.next_power_of_2(T),
                                          BK=triton.next_power_of_2(K))
    return out


@triton.jit
def _tile_kernel(k_ptr, gc_ptr, out_ptr, row_start, col_start, K, BC: tl.constexpr, BK: tl.constexpr,
                 FACTORED: tl.constexpr):
    local, cols = tl.arange(0, BC), tl.arange(0, BK)
    mask = cols[None, :] < K
    offs_r = (row_start + local)[:, None] * K + cols[None, :]
    offs_c = (col_start + local)[:, None] * K + cols[None, :]
    k_r, g_r = tl.load(k_ptr + offs_r, mask=mask, other=0.0), tl.load(gc_ptr + offs_r, mask=mask, other=0.0)
    k_c, g_c = tl.load(k_ptr + offs_c, mask=mask, other=0.0), tl.load(gc_ptr + offs_c, mask=mask, other=0.0)
    if FACTORED:  # e^{G_r} · e^{−G_i}: e^{−G_i} overflows fp32 at strong decay
        rows_scaled, cols_scaled = k_r * tl.exp(g_r), k_c * tl.exp(-g_c)
    else:
        g_ref = tl.load(gc_ptr + row_start * K + cols, mask=cols < K, other=0.0)
        rows_scaled, cols_scaled = k_r * tl.exp(g_r - g_ref[None, :]), k_c * tl.exp(g_ref[None, :] - g_c)
    tile = tl.dot(rows_scaled, tl.trans(cols_scaled), input_precision="ieee")
    tl.store(out_ptr + local[:, None] * BC + local[None, :], tile)


def _launch_tile(k, gc, row_start, col_start, size, block, factored):
    out = torch.zeros(size, size, dtype=torch.float32)
    _tile_kernel[(1,)](k.contiguous(), gc.contiguous(), out, row_start, col_start, k.shape[1], BC=block,
                       BK=max(16, triton.next_power_of_2(k.shape[1])), FACTORED=factored)
    return out


def tile_factored_naively(k, gc, row_start, col_start, size=16):
    """(K_r ⊙ e^{G_r})(K_i ⊙ e^{−G_i})ᵀ in the kernel: NaN once −G passes 88."""
    return _launch_tile(k, gc, row_start, col_start, size, size, factored=True)


def tile_always_16_wide(k, gc, row_start, col_start, size=16):
    """Hard-codes BC = 16: a wider tile is only partly written (the kernel stores at stride 16, too)."""
    return _launch_tile(k, gc, row_start, col_start, size, 16, factored=False)


def tile_in_torch(k, gc, row_start, col_start, size=16):
    """The right tile, in torch."""
    rows, cols = slice(row_start, row_start + size), slice(col_start, col_start + size)
    ref = gc[row_start]
    return (k[rows] * torch.exp(gc[rows] - ref)) @ (k[cols] * torch.exp(ref - gc[cols])).T


@triton.jit
def _store_far_out_of_range_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=0.0)
    tl.store(y_ptr + (row * n_cols + cols) * 100_000_000, x)  # no mask, and a stride that leaves the tensor


def l2norm_unmasked_store_crashes(x):
    """An unmasked store far outside the output: kills the process that runs it (SIGSEGV under the interpreter)."""
    y = torch.empty_like(x)
    _store_far_out_of_range_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


WRONG = {
    "08.l2norm_rows": [l2norm_in_torch, l2norm_eps_outside_sqrt, l2norm_unmasked_store_crashes],
    "08.chunk_cumsum": [cumsum_one_chunk_for_all],
    "08.kk_tile": [tile_factored_naively, tile_always_16_wide, tile_in_torch],
}
