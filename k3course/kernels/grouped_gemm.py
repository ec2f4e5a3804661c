"""MoE grouped GEMM: every expert's matmul over expert-sorted tokens in one kernel launch.

After routing, tokens are sorted by expert (``k3course.moe.dispatch``), so expert e owns the contiguous rows
``[offsets[e-1], offsets[e])`` of ``x_sorted`` (offsets[-1] = 0). Instead of one matmul per expert (E launches,
most of them tiny at decode time), the row range of every expert is cut into BM-row tiles and one launch runs
all the tiles: program (tile, n-block) looks up which expert its tile belongs to and multiplies its rows by that
expert's weight. Nothing is read back to the host: the tile table is built on the device with a prefix sum and
``searchsorted``, and the grid is sized by the upper bound ⌈M / BM⌉ + E (programs past the last tile exit).

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


def _launch(x: torch.Tensor, weights: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """out = per-expert x @ weights[e]; weights may be any strided view (e.g. a transpose)."""
    M, K = x.shape
    E, _, N = weights.shape
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
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


def _weight_grad(x: torch.Tensor, grad_out: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """dW[e] = x_eᵀ grad_out_e, expert by expert (the backward's weight gradient)."""
    E = group_ends.numel()
    grad_w = torch.zeros(E, x.shape[1], grad_out.shape[1], dtype=torch.float32, device=x.device)
    bounds = torch.cat([group_ends.new_zeros(1), group_ends]).tolist()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            grad_w[e] = x[lo:hi].float().T @ grad_out[lo:hi].float()
    return grad_w


class _GroupedGemmFunction(torch.autograd.Function):
    """Forward and input gradient are the grouped kernel (the latter with the transposed weights, a free view);
    the weight gradient is a per-expert loop of torch matmuls."""

    @staticmethod
    def forward(ctx, x, weights, group_ends):
        ctx.save_for_backward(x, weights, group_ends)
        return _launch(x, weights, group_ends)

    @staticmethod
    def backward(ctx, grad_out):
        x, weights, group_ends = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _launch(grad_out.contiguous(), weights.transpose(1, 2), group_ends)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(x, grad_out, group_ends).to(weights.dtype)
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
