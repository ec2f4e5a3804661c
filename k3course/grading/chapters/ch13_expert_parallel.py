"""Chapter 13 exercises: the dispatch plan of expert parallelism (split sizes, permutation, inverse, combine) and
the differentiable uneven all-to-all, graded on gloo ranks that the grader forks."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from k3course.distributed import all_to_all, combine, dispatch_permutation, inverse_permutation, run_ranks, split_sizes
from k3course.distributed.launch import RankFailed
from k3course.grading.fresh_stack import call_on_fresh_stack
from k3course.grading.registry import Backward, Case, Exercise, Forbidden, register


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


class RankRaised(RuntimeError):
    """The answer raised on one of the ranks; the message names the rank and the error (its last line)."""


TORCHS_OWN = Forbidden(frozenset({"all_to_all_single"}),
                       "torch.distributed.nn.functional's differentiable all_to_all_single is the shortcut this "
                       "exercise rules out: write the autograd.Function around dist.all_to_all_single yourself",
                       made_in=(os.path.join("torch", "distributed", "nn", ""),
                                os.path.join("torch", "distributed", "_functional_collectives")))


def _seeded(generator: torch.Generator, n: int, width: int, dtype: torch.dtype, strided: bool) -> torch.Tensor:
    """[n, width] seeded numbers; ``strided``: the transpose of a [width, n] tensor (not contiguous)."""
    if strided:
        return torch.randn(width, n, generator=generator, dtype=dtype).t()
    return torch.randn(n, width, generator=generator, dtype=dtype)


def _my_group(rank: int, n_groups: int, group_size: int):
    """None for one group (the default one); else every rank makes all ``n_groups`` groups of consecutive ranks
    (new_group is collective) and gets its own."""
    if n_groups == 1:
        return None
    groups = [dist.new_group(list(range(i * group_size, (i + 1) * group_size))) for i in range(n_groups)]
    return groups[rank // group_size]


def _exchange_rank(rank: int, world_size: int, answer, counts: list[list[int]], width: int, dtype: str,
                   seed: int, n_groups: int, strided: bool) -> dict:
    """On rank r, member r' = r mod P of its group of P = len(counts) ranks: rows [Σ_q counts[r'][q], width]
    (seeded, a leaf), received = answer(rows, recv_splits, send_splits[, group=its group when n_groups > 1]) with
    send_splits = counts[r'], recv_splits = [counts[q][r'] for q]; then the backward of Σ g ⊙ received for a
    seeded g. ``strided``: rows and g are transposed views, not contiguous. -> {"received": [Σ_q counts[q][r'],
    width], "gradient of rows": like rows, or None without one}.

    A stub's NotImplementedError (forward or backward) comes back as the value "not done" (every rank raises it at
    the same point).
    The ranks agree (an all-reduce) that every result has the right shape and a gradient path before any
    backward, so a wrong shape on one rank is reported, not waited for.
    """
    group, member = _my_group(rank, n_groups, len(counts)), rank % len(counts)
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    send_splits, recv_splits = list(counts[member]), [row[member] for row in counts]
    rows = _seeded(generator, sum(send_splits), width, getattr(torch, dtype), strided).requires_grad_()
    upstream = _seeded(generator, sum(recv_splits), width, rows.dtype, strided)
    on_group = {} if group is None else {"group": group}
    try:
        received = answer(rows, recv_splits, send_splits, **on_group)
        differentiable = (isinstance(received, torch.Tensor) and received.shape == upstream.shape
                          and received.dtype == rows.dtype and received.requires_grad)
        agreed = torch.tensor([int(differentiable)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if agreed.item():  # the learner's backward runs on a fresh stack too, without torch's own exchange
            call_on_fresh_stack(torch.autograd.backward, (received, upstream), {}, TORCHS_OWN)
    except NotImplementedError:  # the forward's stub, or the backward's
        return "not done"
    detached = received.detach() if isinstance(received, torch.Tensor) else received
    return {"received": detached, "gradient of rows": rows.grad}


def exchange_on_ranks(answer, counts: list[list[int]], width: int, dtype: str = "float32", seed: int = 0,
                      n_groups: int = 1, strided: bool = False) -> dict:
    """Run ``answer`` (an uneven all-to-all: ``answer(rows, recv_splits, send_splits[, group=...])``) on
    n_groups · P gloo ranks forked here, P = len(counts), in ``n_groups`` process groups of P consecutive ranks
    (one: the default group, no group passed); within a group counts[q][r] rows go from member q to member r.
    -> {"rank r": {"received", "gradient of rows"}} (see :func:`_exchange_rank`). A rank's error is raised here
    as :class:`RankRaised` naming it."""
    try:
        results = run_ranks(_exchange_rank, n_groups * len(counts), answer, counts, width, dtype, seed, n_groups,
                            strided, timeout_s=60.0, collective_timeout_s=10.0, start_method="fork")
    except RankFailed as failure:
        lines = str(failure).strip().splitlines()  # "rank r failed first ...:", its traceback; or one line
        last = f": {lines[-1]}" if len(lines) > 1 else ""
        raise RankRaised(f"{lines[0].split(' failed first')[0]}{last}") from None
    if "not done" in results:
        raise NotImplementedError("the all-to-all is still the stub")
    return {f"rank {rank}": result for rank, result in enumerate(results)}


def _exchange_cases() -> list[Case]:
    return [Case("2 ranks, uneven splits", ([[1, 3], [2, 0]], 4)),
            Case("3 ranks sending and receiving 3 rows each, not to the ranks they receive from",
                 ([[1, 2, 0], [0, 1, 2], [2, 0, 1]], 5)),
            Case("3 ranks: one sends nothing, one receives nothing", ([[0, 0, 0], [2, 1, 0], [1, 3, 0]], 3)),
            Case("float64 rows keep their dtype; each rank keeps its own rows", ([[3, 0], [0, 2]], 2, "float64")),
            Case("rows and upstream gradient not contiguous (transposed views)", ([[1, 3], [2, 2]], 3),
                 {"strided": True}),
            Case("two process groups of 2 ranks each, not the default group", ([[1, 3], [2, 0]], 4),
                 {"n_groups": 2})]


register(Exercise("13.split_sizes", split_sizes, _split_cases))
register(Exercise("13.dispatch_permutation", dispatch_permutation, _permutation_cases))
register(Exercise("13.inverse_permutation", inverse_permutation, _inverse_cases))
register(Exercise("13.combine", combine, _combine_cases, backward=Backward()))
register(Exercise("13.all_to_all", all_to_all, _exchange_cases, forbidden=TORCHS_OWN, harness=exchange_on_ranks))
