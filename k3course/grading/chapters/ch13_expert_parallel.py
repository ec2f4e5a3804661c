"""Chapter 13 exercises: the dispatch plan of expert parallelism (split sizes, permutation, inverse, combine)."""

from __future__ import annotations

import torch

from k3course.distributed import combine, dispatch_permutation, inverse_permutation, split_sizes
from k3course.grading import Case, Exercise, register


def _routing(m: int, n: int, k: int, seed: int) -> torch.Tensor:
    """expert_idx [m, k]: k distinct experts per token, drawn from n."""
    scores = torch.rand(m, n, generator=torch.Generator().manual_seed(seed))
    return scores.topk(k, dim=1).indices


def _split_cases() -> list[Case]:
    hot = _routing(9, 8, 2, 3).clamp(max=3)  # every slot lands on the first ranks: others get 0
    return [Case("m=20, n=8 experts on P=4 ranks", (_routing(20, 8, 3, 1), 8, 4)),
            Case("n=10 on P=4 (blocks of 3, 3, 2, 2)", (_routing(17, 10, 4, 2), 10, 4)),
            Case("ranks that receive nothing", (hot, 8, 4)),
            Case("P=1 keeps everything", (_routing(5, 6, 2, 4), 6, 1))]


def _permutation_cases() -> list[Case]:
    tied = torch.tensor([[3, 1], [1, 3], [3, 0], [1, 2]])  # several tokens per expert: stable order matters
    return [Case("m=20, k=3, n=8", (_routing(20, 8, 3, 5),)),
            Case("tokens sharing experts (keep token order within an expert)", (tied,)),
            Case("k=1", (_routing(7, 5, 1, 6),))]


def _inverse_cases() -> list[Case]:
    return [Case("a permutation of 24", (torch.randperm(24, generator=torch.Generator().manual_seed(7)),)),
            Case("a dispatch order", (dispatch_permutation(_routing(9, 6, 2, 8)),)),
            Case("one element", (torch.zeros(1, dtype=torch.int64),))]


def _combine_cases() -> list[Case]:
    g = torch.Generator().manual_seed(9)
    expert_idx = _routing(11, 8, 3, 10)
    weights = torch.softmax(torch.randn(11, 3, generator=g), -1)
    returned = torch.randn(33, 5, generator=g)
    one = torch.tensor([[2]])
    sigmoid = torch.sigmoid(torch.randn(11, 3, generator=g))
    return [Case("m=11, k=3, w=5", (returned, dispatch_permutation(expert_idx), weights)),
            Case("weights that do not sum to 1 (sigmoid router, not renormalised)",
                 (returned, dispatch_permutation(expert_idx), sigmoid)),
            Case("bfloat16 outputs, float32 weights: the output keeps the outputs' dtype",
                 (returned.bfloat16(), dispatch_permutation(expert_idx), weights)),
            Case("k=1, one token", (torch.randn(1, 4, generator=g), dispatch_permutation(one), torch.ones(1, 1))),
            Case("float64 keeps its dtype", (returned.double(), dispatch_permutation(expert_idx), weights.double()))]


register(Exercise("13.split_sizes", split_sizes, _split_cases))
register(Exercise("13.dispatch_permutation", dispatch_permutation, _permutation_cases))
register(Exercise("13.inverse_permutation", inverse_permutation, _inverse_cases))
register(Exercise("13.combine", combine, _combine_cases))
