"""Plausible wrong answers for chapter 03's Triton margin histogram: a bin off by one, counts lost without atomics,
a mask or a clamp forgotten, and torch where a kernel is asked. One kernel with switches makes each mistake."""

import k3course.kernels

k3course.kernels.select_triton_mode()  # first, before triton loads: the interpreter on a CPU (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _histogram_kernel(x_ptr, e_ptr, c_ptr, M, N, bins, stride_m, stride_n, BM: tl.constexpr, BN: tl.constexpr,
                      STRICT: tl.constexpr, ATOMIC: tl.constexpr, MASK: tl.constexpr, CLAMP: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    experts = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (rows[:, None] < M) & (experts[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_m + experts[None, :] * stride_n, mask=ok, other=0.0).to(tl.float64)
    below = tl.zeros([BM, BN], dtype=tl.int32)
    for b in range(bins + 1):  # how many edges lie below x (≤, or < with STRICT)
        edge = tl.load(e_ptr + b).to(tl.float64)
        below += ((edge < x) if STRICT else (edge <= x)).to(tl.int32)
    which = below - 1
    if CLAMP:
        which = tl.minimum(tl.maximum(which, 0), bins - 1)
    pointers = c_ptr + experts[None, :] * bins + which
    if ATOMIC:
        tl.atomic_add(pointers, 1, mask=ok if MASK else None)
    else:
        tl.store(pointers, tl.load(pointers, mask=ok) + 1, mask=ok)


def _launch(margins, edges, strict=False, atomic=True, mask=True, clamp=True):
    m, n = margins.shape
    bins = edges.numel() - 1
    counts = torch.zeros(n, bins, dtype=torch.int32)
    if m:
        _histogram_kernel[(triton.cdiv(m, 16), triton.cdiv(n, 16))](
            margins, edges, counts, m, n, bins, *margins.stride(), BM=16, BN=16, STRICT=strict, ATOMIC=atomic,
            MASK=mask, CLAMP=clamp)
    return counts.long()


def histogram_edge_off_by_one(margins, edges):
    """Counts the edges strictly below x: a margin on an edge falls into the bin under it."""
    return _launch(margins, edges, strict=True)


def histogram_without_atomics(margins, edges):
    """Load, add one, store: tokens of one tile in the same bin overwrite each other's count."""
    return _launch(margins, edges, atomic=False)


def histogram_ignoring_the_mask(margins, edges):
    """The tile's padding (loaded as 0.0) is counted too, and experts past the last one write past the counts."""
    return _launch(margins, edges, mask=False)


def histogram_without_the_clamp(margins, edges):
    """A margin on the last edge goes to bin ``bins``: the next expert's first bin (or past the end)."""
    return _launch(margins, edges, clamp=False)


def histogram_in_torch(margins, edges):
    """The right counts, in torch."""
    bins = edges.numel() - 1
    which = (torch.bucketize(margins.double(), edges.double(), right=True) - 1).clamp(0, bins - 1)
    return torch.stack([torch.bincount(column, minlength=bins) for column in which.T])


WRONG = {
    "03.margin_histogram_kernel": [histogram_edge_off_by_one, histogram_without_atomics, histogram_ignoring_the_mask,
                                   histogram_without_the_clamp, histogram_in_torch],
}
