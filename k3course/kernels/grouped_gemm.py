"""MoE grouped GEMM: every expert's matmul over expert-sorted tokens in one kernel launch.

After routing, tokens are sorted by expert (``k3course.moe.dispatch``), so expert e owns the contiguous rows
``[offsets[e-1], offsets[e])`` of ``x_sorted`` (offsets[-1] = 0). Instead of one matmul per expert (E launches,
most of them tiny at decode time), the row range of every expert is cut into BM-row tiles and one launch runs
all the tiles: program (tile, n-block) looks up which expert its tile belongs to and multiplies its rows by that
expert's weight. Nothing is read back to the host: the tile table is built on the device with a prefix sum and
``searchsorted``, and the grid is sized by the upper bound ⌈M / BM⌉ + E (programs past the last tile exit).

The backward is two more launches, offsets still on the device. dX_e = dY_e W_eᵀ is the same kernel on the
transposed weights (a strided view, no copy). dW_e = X_eᵀ dY_e is a grouped reduction: program (e, k-block,
n-block) owns one [BK, BN] tile of dW_e and walks expert e's rows in BM-row steps, accumulating in fp32; the
loop bounds are the expert's offsets, loaded inside the kernel, so an empty expert's programs store zeros.

This is the pattern of vLLM's fused MoE and torchtitan's grouped experts; ``torch._grouped_mm`` is the peer.
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def _configs() -> list[triton.Config]:
    """Tile widths to autotune over on a GPU; one config under the interpreter (autotuning needs a GPU).

    The tile height BM is not tuned: the tile table is built before the launch, so BM is chosen from the shape.
    """
    if TRITON_MODE != "native":
        return [triton.Config({"BN": 32, "BK": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in [(128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3)]]


@triton.autotune(configs=_configs(), key=["N", "K", "BM"])
@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, group_start_ptr, group_end_ptr, tile_expert_ptr, tile_first_ptr,
                         N, K, E, stride_xm, stride_we, stride_wk, stride_wn, stride_om,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EXACT_FP32: tl.constexpr):
    """out[rows of expert e] = x[rows of expert e] @ w[e], one [BM, BN] output tile per program."""
    tile, n_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)  # E for the spare programs of the upper-bound grid
    if expert < E:
        first_tile = tl.load(tile_first_ptr + expert)  # index of the expert's first tile
        row_start = tl.load(group_start_ptr + expert) + (tile - first_tile) * BM
        row_end = tl.load(group_end_ptr + expert)
        rows = row_start + tl.arange(0, BM)
        cols = n_block * BN + tl.arange(0, BN)
        depth = tl.arange(0, BK)
        row_ok, col_ok = rows < row_end, cols < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + depth)[None, :],
                        mask=row_ok[:, None] & (k0 + depth < K)[None, :], other=0.0)
            w = tl.load(w_ptr + expert.to(tl.int64) * stride_we + (k0 + depth)[:, None] * stride_wk
                        + cols[None, :] * stride_wn, mask=(k0 + depth < K)[:, None] & col_ok[None, :], other=0.0)
            if EXACT_FP32:  # fp32 data: true fp32 products, not TF32
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile: the average group size rounded up to a power of two, between 16 and 128."""
    return min(128, max(16, triton.next_power_of_2(max(1, num_rows // max(1, num_experts)))))


def _tile_table(group_ends: torch.Tensor, tile_rows: int, num_rows: int):
    """Tile → expert map, built on the device without a host sync.

    Returns group_start [E], tile_expert [max_tiles] (E for tiles past the last one), tile_first [E] (index of
    each expert's first tile) and max_tiles = ⌈M / BM⌉ + E, an upper bound on the number of tiles.
    """
    ends = group_ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles_per_expert = (ends - starts + tile_rows - 1) // tile_rows  # [E]; 0 for an empty expert
    tile_ends = tiles_per_expert.cumsum(0)  # [E] exclusive end of each expert's tiles
    max_tiles = triton.cdiv(num_rows, tile_rows) + ends.numel()
    tile_ids = torch.arange(max_tiles, device=ends.device)
    tile_expert = torch.searchsorted(tile_ends, tile_ids, right=True)  # [max_tiles]
    return starts, tile_expert, tile_ends - tiles_per_expert, max_tiles


def _launch(x: torch.Tensor, weights: torch.Tensor, group_ends: torch.Tensor,
            unowned_rows_zero: bool = False) -> torch.Tensor:
    """out = per-expert x @ weights[e]; weights may be any strided view (e.g. a transpose). Rows past the last
    end are left uninitialised, or zero with ``unowned_rows_zero`` (an input gradient: they touched nothing)."""
    M, K = x.shape
    E, _, N = weights.shape
    out = (torch.zeros if unowned_rows_zero else torch.empty)(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    x = x.contiguous()
    tile_rows = _tile_rows(M, E)
    starts, tile_expert, tile_first, max_tiles = _tile_table(group_ends, tile_rows, M)
    ends = group_ends.to(torch.int64)
    grid = lambda meta: (max_tiles, triton.cdiv(N, meta["BN"]))
    _grouped_gemm_kernel[grid](x, weights, out, starts, ends, tile_expert, tile_first, N, K, E, x.stride(0),
                               weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0), BM=tile_rows,
                               EXACT_FP32=x.dtype == torch.float32)
    return out


def _weight_grad_configs() -> list[triton.Config]:
    """dW tile shapes (BK × BN output, BM rows per step of the reduction) to autotune over on a GPU; one under
    the interpreter."""
    if TRITON_MODE != "native":
        return [triton.Config({"BM": 16, "BK": 32, "BN": 32}, num_warps=4, num_stages=1)]
    shapes = [(64, 64, 64, 4, 3), (32, 128, 128, 8, 3), (64, 128, 64, 4, 4), (32, 64, 128, 4, 4)]
    return [triton.Config({"BM": bm, "BK": bk, "BN": bn}, num_warps=w, num_stages=s) for bm, bk, bn, w, s in shapes]


@triton.autotune(configs=_weight_grad_configs(), key=["K", "N"])
@triton.jit
def _grouped_weight_grad_kernel(x_ptr, dy_ptr, dw_ptr, group_start_ptr, group_end_ptr, K, N,
                                stride_xm, stride_dym, stride_we, stride_wk,
                                BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, EXACT_FP32: tl.constexpr):
    """dW[e] tile = Σ over expert e's rows m of x[m, k-block]ᵀ dy[m, n-block], one [BK, BN] tile per program.

    The reduction walks the expert's own rows [start, end) in BM-row steps, bounds read on the device; an
    empty expert runs no step and stores zeros.
    """
    expert, k_block, n_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row_start = tl.load(group_start_ptr + expert)
    row_end = tl.load(group_end_ptr + expert)
    depth = k_block * BK + tl.arange(0, BK)
    cols = n_block * BN + tl.arange(0, BN)
    depth_ok, col_ok = depth < K, cols < N
    acc = tl.zeros([BK, BN], dtype=tl.float32)
    for first_row in range(row_start, row_end, BM):
        rows = first_row + tl.arange(0, BM)
        row_ok = rows < row_end
        x_t = tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_xm + depth[:, None],
                      mask=depth_ok[:, None] & row_ok[None, :], other=0.0)           # [BK, BM]: x rows, transposed
        dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_dym + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)              # [BM, BN]
        if EXACT_FP32:
            acc = tl.dot(x_t, dy, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_t, dy, acc)
    tl.store(dw_ptr + expert.to(tl.int64) * stride_we + depth[:, None] * stride_wk + cols[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=depth_ok[:, None] & col_ok[None, :])


def _weight_grad(x: torch.Tensor, grad_out: torch.Tensor, group_ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dW[e] = x_eᵀ grad_out_e for every expert in one launch (a grouped reduction, fp32 accumulation).

    x [M, K], grad_out [M, N], group_ends [E] (on the device, never read back) -> dW [E, K, N] in ``dtype``;
    zero for an expert with no rows.
    """
    (M, K), N, E = x.shape, grad_out.shape[1], group_ends.numel()
    grad_w = torch.empty(E, K, N, dtype=dtype, device=x.device)
    if M == 0:
        return grad_w.zero_()
    x, grad_out = x.contiguous(), grad_out.contiguous()
    ends = group_ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    grid = lambda meta: (E, triton.cdiv(K, meta["BK"]), triton.cdiv(N, meta["BN"]))
    _grouped_weight_grad_kernel[grid](x, grad_out, grad_w, starts, ends, K, N, x.stride(0), grad_out.stride(0),
                                      grad_w.stride(0), grad_w.stride(1), EXACT_FP32=x.dtype == torch.float32)
    return grad_w


class _GroupedGemmFunction(torch.autograd.Function):
    """All three products are grouped Triton launches that read the offsets on the device only:
    forward Y_e = X_e W_e; input gradient dX_e = dY_e W_eᵀ (the forward kernel on the transposed weights, a free
    view; rows no expert owns get zero); weight gradient dW_e = X_eᵀ dY_e (:func:`_weight_grad`)."""

    @staticmethod
    def forward(ctx, x, weights, group_ends):
        ctx.save_for_backward(x, weights, group_ends)
        return _launch(x, weights, group_ends)

    @staticmethod
    def backward(ctx, grad_out):
        x, weights, group_ends = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _launch(grad_out.contiguous(), weights.transpose(1, 2), group_ends, unowned_rows_zero=True)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(x, grad_out, group_ends, weights.dtype)
        return grad_x, grad_w, None


def moe_grouped_gemm(x_sorted: torch.Tensor, expert_weights: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """All experts' matmuls in one launch: out[i] = x_sorted[i] @ expert_weights[e(i)].

    x_sorted: [M, K] tokens sorted by expert; expert_weights: [E, K, N]; group_offsets: [E] integer END offsets
    (the ``torch._grouped_mm`` convention: expert e owns rows [group_offsets[e-1], group_offsets[e]), with
    group_offsets[-1] = 0 before the first, non-decreasing, last ≤ M; rows past the last end are left
    uninitialised, as in torch). Empty experts are allowed. Returns [M, N] in x's dtype, accumulated in fp32.
    Differentiable in x_sorted and expert_weights.
    """
    if x_sorted.dim() != 2:
        raise ValueError(f"x_sorted must be [M, K], got shape {tuple(x_sorted.shape)}")
    if expert_weights.dim() != 3 or expert_weights.shape[1] != x_sorted.shape[1]:
        raise ValueError(f"expert_weights must be [E, K, N] with K = {x_sorted.shape[1]}, "
                         f"got shape {tuple(expert_weights.shape)}")
    if group_offsets.dim() != 1 or group_offsets.numel() != expert_weights.shape[0]:
        raise ValueError(f"group_offsets must be [E] = [{expert_weights.shape[0]}] end offsets, "
                         f"got shape {tuple(group_offsets.shape)}")
    if group_offsets.is_floating_point():
        raise TypeError(f"group_offsets must be an integer tensor, got {group_offsets.dtype}")
    if x_sorted.dtype != expert_weights.dtype:
        raise TypeError(f"expert_weights must have x_sorted's dtype {x_sorted.dtype}, got {expert_weights.dtype}")
    if TRITON_MODE == "interpreter" and x_sorted.dtype != torch.float32:
        raise TypeError(f"x_sorted: the Triton interpreter needs fp32 inputs, got {x_sorted.dtype}")
    return _GroupedGemmFunction.apply(x_sorted, expert_weights, group_offsets)
