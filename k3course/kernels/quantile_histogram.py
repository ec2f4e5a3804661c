"""Quantile balancing's margin histogram in one launch (lesson 03).

Quantile balancing reads each expert's (q+1)-th largest margin x_tj = s_tj − α_t off a per-expert histogram over
shared edges e_0 < e_1 < … < e_bins, so that ranks can pool their counts with one all-reduce
(:func:`k3course.moe.balancing.histogram_quantile_bias`). The count of expert j in bin b is

    counts[j, b] = #{t : bin(x_tj) = b},   bin(x) = clamp(#{e ∈ edges : e ≤ x} − 1, 0, bins − 1)

(``torch.bucketize(x, edges, right=True) − 1``: a margin on the last edge goes in the last bin). One program owns
a [BM tokens, BN experts] tile of the margins: it finds each margin's bin by a binary search over the edges
(⌈log₂(bins + 2)⌉ steps, exact for any increasing edges, not only evenly spaced ones), then adds 1 to its
(expert, bin) counter with an atomic add, since tiles of different tokens hit the same counters. The counts are
integers, so the order the atomics land in changes nothing. Forward only: training never differentiates counts.
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MARGIN_DTYPES = (torch.float64, torch.float32)


@triton.jit
def _histogram_kernel(margins_ptr, edges_ptr, counts_ptr, M, N, bins, stride_mm, stride_mn,
                      BM: tl.constexpr, BN: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """counts[j, bin(x_tj)] += 1 for the [BM, BN] tile of margins of this program."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    experts = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (experts < N)[None, :]
    x = tl.load(margins_ptr + rows[:, None].to(tl.int64) * stride_mm + experts[None, :] * stride_mn, mask=mask,
                other=0.0).to(tl.float64)
    # binary search for c = #{edges ≤ x} in [0, bins + 1]: the invariant low ≤ c ≤ high
    low = tl.zeros([BM, BN], dtype=tl.int32)
    high = tl.zeros([BM, BN], dtype=tl.int32) + bins + 1
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high + 1) // 2  # is c ≥ middle, i.e. edge middle − 1 ≤ x?
        edge = tl.load(edges_ptr + middle - 1, mask=mask & (middle > 0), other=float("inf")).to(tl.float64)
        below = edge <= x
        low = tl.where(below, middle, low)
        high = tl.where(below, high, middle - 1)
    which = tl.minimum(tl.maximum(low - 1, 0), bins - 1)
    tl.atomic_add(counts_ptr + experts[None, :].to(tl.int64) * bins + which, 1, mask=mask)


def margin_histogram_triton(margins: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """:func:`k3course.moe.balancing.margin_histogram` as one Triton launch.

    counts[j, b] = #{t : edges[b] ≤ margins[t, j] < edges[b + 1]} (the last bin also takes the last edge; margins
    below the first edge count in the first bin, above the last in the last).
    margins [m, n] float64 or float32 (any strides, m may be 0); edges [bins + 1] increasing, on the margins'
    device -> counts [n, bins] int64. Compared in float64, as torch.bucketize on float64 margins does.
    """
    if not isinstance(margins, torch.Tensor) or margins.dim() != 2 or margins.dtype not in MARGIN_DTYPES:
        what = (f"{tuple(margins.shape)} {margins.dtype}" if isinstance(margins, torch.Tensor)
                else type(margins).__name__)
        raise ValueError(f"margins must be a [m, n] tensor of {MARGIN_DTYPES}, got {what}")
    if not isinstance(edges, torch.Tensor) or edges.dim() != 1 or edges.numel() < 2:
        what = tuple(edges.shape) if isinstance(edges, torch.Tensor) else type(edges).__name__
        raise ValueError(f"edges must be a [bins + 1 ≥ 2] tensor, got {what}")
    if edges.device != margins.device:
        raise ValueError(f"edges must be on the margins' device {margins.device}, got {edges.device}")
    m, n = margins.shape
    bins = edges.numel() - 1
    counts = torch.zeros(n, bins, dtype=torch.int32, device=margins.device)  # int32 atomics; m < 2^31
    if m == 0 or n == 0:
        return counts.long()
    rows, experts = 32, min(64, triton.next_power_of_2(n))
    grid = (triton.cdiv(m, rows), triton.cdiv(n, experts))
    _histogram_kernel[grid](margins, edges.to(torch.float64).contiguous(), counts, m, n, bins, *margins.stride(),
                            BM=rows, BN=experts, SEARCH_STEPS=(bins + 1).bit_length())
    return counts.long()
