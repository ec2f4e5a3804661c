"""Chapter 03, the Triton rung: quantile balancing's per-expert margin histogram as one kernel (bins by the
shared edges, atomic counts). The reference is the package's kernel, equal to its torch histogram (refused too)."""

from __future__ import annotations

import torch

from k3course.grading.chapters.ch08_triton import TORCH_MATH
from k3course.grading.registry import Case, Exercise, Forbidden, register
from k3course.kernels.quantile_histogram import margin_histogram_triton
from k3course.moe.balancing import margin_histogram, quantile_margins

NO_TORCH_BINNING = Forbidden(
    TORCH_MATH.names | {"bucketize", "searchsorted", "bincount", "histc", "histogram", "scatter_add", "scatter_add_",
                        "index_add", "index_add_", "index_put_", "put_", "floor", "floor_divide", "clamp", "clip",
                        "eq", "ge", "gt", "le", "lt", "count_nonzero"},
    "this exercise asks for a Triton kernel: bin and count in the kernel, and use torch only to allocate the "
    "counts and to change their dtype")


def _margins(m: int, n: int, seed: int, k: int = 2) -> torch.Tensor:
    """Seeded margins s_tj − α_t (float64) of m tokens over n experts, k experts chosen per token."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(m, n, generator=g) + torch.randn(n, generator=g))
    return quantile_margins(scores, torch.zeros(n), k)


def _edges(margins: torch.Tensor, bins: int) -> torch.Tensor:
    return torch.linspace(float(margins.min()), float(margins.max()), bins + 1, dtype=torch.float64)


def _histogram_cases() -> list[Case]:
    odd = _margins(37, 5, 300)
    many = _margins(40, 9, 301, k=3)
    on_edges = torch.tensor([[0.0, 0.5, 1.0], [0.25, 0.75, 0.0], [1.0, 0.25, 0.5]], dtype=torch.float64)
    quarters = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    crowd = torch.full((150, 3), 0.3, dtype=torch.float64)
    return [
        Case("37 tokens, 5 experts, 16 bins (partial blocks)", (odd, _edges(odd, 16))),
        Case("margins on the edges: a margin on an edge counts in the bin above it, on the last edge in the last bin",
             (on_edges, quarters)),
        Case("margins below the first and above the last edge land in the first and last bin",
             (4 * on_edges - 1.5, quarters)),
        Case("uneven (cubic) edges", (odd, torch.linspace(-1.0, 1.0, 12, dtype=torch.float64) ** 3)),
        Case("one bin", (odd, _edges(odd, 1))),
        Case("strided margins (a transposed [n, m] tensor)", (odd.T.contiguous().T, _edges(odd, 16))),
        Case("150 tokens in one bin: concurrent adds to one counter", (crowd, quarters)),
        Case("float32 margins", (odd.float(), _edges(odd, 8))),
        Case("256 bins (the package's default), 40 tokens, 9 experts", (many, _edges(many, 256))),
        Case("zero tokens", (odd[:0], _edges(odd, 16))),
    ]


register(Exercise("03.margin_histogram_kernel", margin_histogram_triton, _histogram_cases, forbidden=NO_TORCH_BINNING,
                  isolate=True, package=(margin_histogram,), guard_bands=True))
