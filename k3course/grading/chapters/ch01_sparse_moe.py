"""Chapter 01 exercises: top-k routing with a selection-only bias, sort-based dispatch and its inverse,
the Switch aux loss and DeepSeek-V3's sign rule."""

from __future__ import annotations

import torch

from k3course.grading import Backward, Case, Exercise, register
from k3course.moe import sign_rule_update, sort_by_expert, switch_aux_loss, topk_route, unsort


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _scores(m: int, n: int, seed: int, softmax: bool = False) -> torch.Tensor:
    logits = torch.randn(m, n, generator=_generator(seed))
    return torch.softmax(logits, -1) if softmax else torch.sigmoid(logits)


def _topk_cases() -> list[Case]:
    ties = torch.tensor([[0.5, 0.5, 0.5, 0.2, 0.5], [0.9, 0.3, 0.3, 0.3, 0.1], [0.6, 0.6, 0.6, 0.6, 0.6]])
    return [
        Case("k=1", (_scores(37, 8, 1), 1)),
        Case("k=n-1", (_scores(37, 8, 2), 7)),
        Case("a bias that changes which experts win",
             (_scores(41, 16, 3), 4, 0.5 * torch.randn(16, generator=_generator(4)))),
        Case("one expert wins every token (bias +10)", (_scores(20, 6, 5), 2, torch.tensor([0, 0, 10.0, 0, 0, 0]))),
        Case("ties: lower index first", (ties, 2)),
        Case("softmax scores, no renormalisation", (_scores(33, 8, 6, softmax=True), 3), {"renormalize": False}),
        Case("float64 scores: weights keep the scores' dtype", (_scores(19, 8, 7).double(), 3)),
    ]


def _dispatch_cases() -> list[Case]:
    empty = torch.randint(0, 8, (37, 3), generator=_generator(7))
    empty[empty == 5] = 6  # expert 5 gets nothing
    return [
        Case("m=37, k=3, n=8, expert 5 empty", (empty, 8)),
        Case("one expert takes every token", (torch.full((10, 1), 2), 4)),
        Case("m=1", (torch.tensor([[3, 0, 1]]), 4)),
        Case("int32 expert ids: order is still int64", (torch.randint(0, 5, (9, 2), generator=_generator(14),
                                                                       dtype=torch.int32), 5)),
    ]


def _unsort_cases() -> list[Case]:
    idx = torch.randint(0, 8, (37, 3), generator=_generator(8))
    order, _ = sort_by_expert(idx, 8)
    rows = torch.randn(order.numel(), 5, generator=_generator(9))
    single_order, _ = sort_by_expert(torch.tensor([[2, 0], [1, 2]]), 3)
    return [Case("m=37, k=3, n=8", (rows, order)),
            Case("4 slots", (torch.arange(4.0)[:, None], single_order)),
            Case("float64 rows keep their dtype", (rows.double(), order))]


def _aux_cases() -> list[Case]:
    probs = _scores(37, 8, 10, softmax=True)
    skewed = torch.softmax(torch.randn(64, 16, generator=_generator(11)) + torch.linspace(0, 3, 16), -1)
    return [
        Case("m=37, n=8, k=2", (probs, topk_route(probs, 2)[0]), {"alpha": 0.01}),
        Case("skewed router, k=4", (skewed, topk_route(skewed, 4)[0])),
        Case("balanced: loss = alpha", (torch.full((8, 4), 0.25), torch.arange(8)[:, None] % 4), {"alpha": 0.1}),
        Case("float64 probabilities", (probs.double(), topk_route(probs, 2)[0])),
    ]


def _sign_cases() -> list[Case]:
    load = torch.bincount(torch.randint(0, 8, (100,), generator=_generator(12)), minlength=8)
    return [
        Case("random load", (0.01 * torch.randn(8, generator=_generator(13)), load, 1e-3)),
        Case("balanced experts stay put", (torch.tensor([0.1, -0.2, 0.0, 0.1]), torch.tensor([5, 5, 3, 7]), 0.05)),
        Case("mean load 3.25 is not an integer", (torch.zeros(4), torch.tensor([2, 3, 4, 4]), 0.1)),
        Case("bfloat16 bias keeps its dtype", (torch.tensor([0.5, -0.25, 0.0], dtype=torch.bfloat16),
                                                torch.tensor([1, 7, 4]), 0.125)),
    ]


register(Exercise("01.topk_route", topk_route, _topk_cases, backward=Backward(("scores",))))
register(Exercise("01.sort_by_expert", sort_by_expert, _dispatch_cases))
register(Exercise("01.unsort", unsort, _unsort_cases, backward=Backward()))
register(Exercise("01.switch_aux_loss", switch_aux_loss, _aux_cases, backward=Backward()))
register(Exercise("01.sign_rule_update", sign_rule_update, _sign_cases))
