"""Chapter 03 exercises: token cutoffs, the quantile-balancing step, reading it off a pooled histogram,
and the max-violation statistic."""

from __future__ import annotations

import torch

from k3course.grading import Case, Exercise, register
from k3course.moe import bias_from_histogram, max_violation, quantile_balance_bias, token_cutoffs


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _skewed_scores(m: int, n: int, seed: int) -> torch.Tensor:
    g = _generator(seed)
    return torch.sigmoid(torch.randn(m, n, generator=g) + torch.randn(n, generator=g))


def _ties() -> torch.Tensor:
    return torch.tensor([[0.5, 0.5, 0.5, 0.2], [0.9, 0.5, 0.5, 0.5], [0.5, 0.5, 0.1, 0.5]]).repeat(4, 1)


def _cutoff_cases() -> list[Case]:
    return [
        Case("m=37, n=8, k=2, with bias",
             (_skewed_scores(37, 8, 1), 0.1 * torch.randn(8, generator=_generator(2)), 2)),
        Case("k=1", (_skewed_scores(20, 6, 3), torch.zeros(6), 1)),
        Case("k=n-2", (_skewed_scores(20, 6, 4), 0.2 * torch.randn(6, generator=_generator(5)), 4)),
        Case("ties", (_ties(), torch.zeros(4), 2)),
        Case("float64 scores keep their dtype",
             (_skewed_scores(15, 6, 12).double(), torch.zeros(6, dtype=torch.float64), 2)),
    ]


def _quantile_cases() -> list[Case]:
    return [
        Case("m=101, n=16, k=4, with bias",
             (_skewed_scores(101, 16, 6), 0.1 * torch.randn(16, generator=_generator(7)), 4)),
        Case("k=1", (_skewed_scores(37, 8, 8), torch.zeros(8), 1)),
        Case("k=n-1", (_skewed_scores(64, 8, 9), torch.zeros(8), 7)),
        Case("ties", (_ties(), torch.zeros(4), 2)),
        Case("bfloat16 bias: the result keeps the bias dtype",
             (_skewed_scores(40, 8, 13), 0.1 * torch.randn(8, generator=_generator(14)).bfloat16(), 2)),
    ]


def _histogram_cases() -> list[Case]:
    counts = torch.randint(0, 20, (6, 32), generator=_generator(10))
    edges = torch.linspace(-1.0, 0.6, 33, dtype=torch.float64)
    return [
        Case("6 experts, 32 bins, q=40", (counts, edges, 40)),
        Case("q=0: the top margin", (counts, edges, 0)),
        Case("small by hand", (torch.tensor([[5, 0, 2], [1, 1, 5]]), torch.tensor([0.0, 1.0, 2.0, 3.0]), 2)),
        Case("unequal bins (cubic spacing)", (counts, torch.linspace(-1.0, 1.0, 33, dtype=torch.float64) ** 3, 40)),
        Case("int32 counts, float32 edges (exact in fp32): the result is float64",
             (counts.to(torch.int32), torch.arange(33.0) / 16 - 1.0, 25)),
    ]


def _violation_cases() -> list[Case]:
    return [
        Case("random load", (torch.bincount(torch.randint(0, 8, (200,), generator=_generator(11)), minlength=8),)),
        Case("balanced", (torch.tensor([3, 3, 3]),)),
        Case("one expert takes all", (torch.tensor([0, 12, 0, 0]),)),
        Case("mean load 10/3 is not an integer", (torch.tensor([5, 2, 3]),)),
    ]


register(Exercise("03.token_cutoffs", token_cutoffs, _cutoff_cases))
register(Exercise("03.quantile_balance_bias", quantile_balance_bias, _quantile_cases))
register(Exercise("03.bias_from_histogram", bias_from_histogram, _histogram_cases))
register(Exercise("03.max_violation", max_violation, _violation_cases))
