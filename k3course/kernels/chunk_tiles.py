"""The tile helpers that the KDA chunk kernels share, forward (:mod:`k3course.kernels.kda_chunk`) and backward
(:mod:`k3course.kernels.kda_chunk_backward`): offsets and masks of a [B, T, H, width] tile by plain pointer
arithmetic, an fp32-accumulating product, the tile width covering a head dimension, the precision of the
products, and the inverse of a chunk's unit lower-triangular matrix."""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def dot_fp32(a, b, LOW_PRECISION: tl.constexpr):
    """a @ b accumulated in fp32: bf16 tensor-core inputs for bf16 / fp16 data, exact fp32 otherwise."""
    if LOW_PRECISION:  # an if / else, not an early return: Triton compiles the code after a constexpr return too
        product = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        product = tl.dot(a, b, input_precision="ieee")
    return product


@triton.jit
def tile_offsets(b, h, T, H, rows, cols, width):
    """Offsets and mask of the tile rows × cols of a [B, T, H, width] tensor (row = time index, column = channel
    or position in the chunk) for batch b, head h: rows past T and columns past width are masked."""
    offsets = ((b * T + rows[:, None]) * H + h) * width + cols[None, :]
    return offsets, (rows[:, None] < T) & (cols[None, :] < width)


def block_width(n: int) -> int:
    """The tile width covering n channels: a power of two, at least 16 (the smallest tl.dot)."""
    return max(16, triton.next_power_of_2(n))


def low_precision(x: torch.Tensor) -> bool:
    """bf16 / fp16 data: feed tensor cores bf16 (accumulating in fp32); fp32 data: exact fp32 products."""
    return x.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def unit_lower_inverse(akk_ptr, b, h, T, H, chunk, BT: tl.constexpr):
    """X = (I + A_kk)^-1 [BT, BT] in fp32 for one chunk's strictly lower A_kk, read from the rows of a
    [B, T, H, BT] tensor (rows past T read as 0, so X is the identity there).

    Forward substitution, row by row: X = I − A X and A is strictly lower triangular, so row r of X needs only
    rows < r: X_r = e_r − Σ_{i<r} A_ri X_i.
    """
    local = tl.arange(0, BT)
    inverse = (local[:, None] == local[None, :]).to(tl.float32)  # starts as I; row r is replaced at step r
    for r in range(1, BT):
        row = chunk * BT + r
        a_r = tl.load(akk_ptr + ((b * T + row) * H + h) * BT + local, mask=row < T, other=0.0)  # [BT] row r of A
        x_r = tl.where(local == r, 1.0, 0.0) - tl.sum(a_r[:, None] * inverse, axis=0)  # A is 0 from column r on
        inverse = tl.where(local[:, None] == r, x_r[None, :], inverse)
    return inverse
