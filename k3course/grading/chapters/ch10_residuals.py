"""Chapter 10 (attention residuals): depth attention, the sources of Block AttnRes, one Block AttnRes read."""

from __future__ import annotations

import torch

from k3course.grading.registry import Backward, Case, Exercise, register
from k3course.layers.residual import block_attnres_read, block_sources, depth_attention


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _depth_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1000)
    cases = []
    for name, (n, batch, length, d) in {"small": (4, 2, 3, 8), "two sources": (2, 1, 5, 4),
                                        "many sources": (9, 1, 2, 6), "one source": (1, 2, 2, 4)}.items():
        cases.append(Case(name, (_randn(g, d), _randn(g, n, batch, length, d))))
    cases.append(Case("zero query: uniform", (torch.zeros(8), _randn(g, 3, 2, 4, 8))))
    scaled = _randn(g, 3, 1, 4, 8) * torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1, 1)
    cases.append(Case("sources of very different size", (_randn(g, 8), scaled)))
    cases.append(Case("a large query (the softmax must subtract its max)", (100 * _randn(g, 8), _randn(g, 3, 2, 2, 8))))
    cases.append(Case("tiny sources (eps inside the square root)", (_randn(g, 8), 1e-5 * _randn(g, 3, 2, 2, 8))))
    cases.append(Case("every score far below 0, 5 sources", (-100 * torch.ones(8), 1 + 0.1 * _randn(g, 5, 2, 3, 8))))
    cases.append(Case("float64 inputs keep their dtype", tuple(t.double() for t in cases[0].args)))
    return cases


def _outputs(g: torch.Generator, count: int, batch: int = 2, length: int = 3, d: int = 4) -> list[torch.Tensor]:
    return [_randn(g, batch, length, d) for _ in range(count)]


def _sources_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1001)
    cases = []
    for name, (count, block) in {"mid-block": (5, 2), "block just completed": (6, 3), "no outputs yet": (0, 4),
                                 "block size 1 (Full)": (4, 1), "one block covers all": (5, 8),
                                 "first output": (1, 3)}.items():
        cases.append(Case(name, (_randn(g, 2, 3, 4), _outputs(g, count), block)))
    embedding, outputs, block = cases[0].args
    cases.append(Case("float64 inputs keep their dtype", (embedding.double(), [o.double() for o in outputs], block)))
    return cases


def _read_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1002)
    cases = []
    for name, (count, block) in {"mid-block": (5, 2), "block just completed": (4, 4), "no outputs yet": (0, 2),
                                 "block size 1 (Full)": (3, 1), "one block covers all": (6, 12)}.items():
        cases.append(Case(name, (_randn(g, 2, 3, 4), _outputs(g, count), _randn(g, 4), block)))
    cases.append(Case("zero query", (_randn(g, 2, 3, 4), _outputs(g, 5), torch.zeros(4), 2)))
    cases.append(Case("every score far below 0", (1 + 0.1 * _randn(g, 2, 3, 4),
                                                   [1 + 0.1 * o for o in _outputs(g, 5)], -100 * torch.ones(4), 2)))
    embedding, outputs, query, block = cases[0].args
    cases.append(Case("float64 inputs keep their dtype",
                      (embedding.double(), [o.double() for o in outputs], query.double(), block)))
    return cases


register(Exercise("10.depth_attention", depth_attention, _depth_cases, backward=Backward(outputs=(0,))))
register(Exercise("10.block_sources", block_sources, _sources_cases, backward=Backward()))
register(Exercise("10.block_attnres_read", block_attnres_read, _read_cases, backward=Backward()))
