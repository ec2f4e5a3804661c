"""All-to-all exchanges with uneven split sizes, differentiable: the backward of a dispatch is a combine.

``all_to_all_single`` sends rows[offsets_r : offsets_r + send_splits[r]] to rank r and receives
recv_splits[r] rows from rank r, stacked by source rank. The gradient of the received rows goes back along
the same routes reversed: an all-to-all with the two split lists swapped. The same code runs on gloo (CPU
processes) and NCCL (GPUs); split sizes are host ints (every rank must know how many rows to expect).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group=None) -> torch.Tensor:
    """One uneven all-to-all, no autograd. rows [Σ send_splits, ...] -> [Σ recv_splits, ...] grouped by source."""
    if rows.shape[0] != sum(send_splits):
        raise ValueError(f"rows has {rows.shape[0]} rows but send_splits sum to {sum(send_splits)}")
    received = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), recv_splits, send_splits, group=group)
    return received


class _AllToAll(torch.autograd.Function):
    """Forward: :func:`exchange`; backward: the reverse exchange of the gradient (splits swapped)."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits, group):
        ctx.recv_splits, ctx.send_splits, ctx.group = recv_splits, send_splits, group
        return exchange(rows, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad_received):
        grad_rows = _AllToAll.apply(grad_received, ctx.send_splits, ctx.recv_splits, ctx.group)
        return grad_rows, None, None, None


def all_to_all(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group=None) -> torch.Tensor:
    """Differentiable uneven all-to-all: rows [Σ send_splits, w] -> [Σ recv_splits, w]; ∂rows = reverse exchange."""
    return _AllToAll.apply(rows, list(recv_splits), list(send_splits), group)


def exchange_counts(counts: torch.Tensor, recv_splits: list[int], send_splits: list[int], group=None) -> torch.Tensor:
    """Tell every rank how many rows to expect: counts [Σ send_splits] int64 -> [Σ recv_splits] int64.

    E.g. per-expert slot counts: rank r gets, from each source, the counts of r's own experts.
    """
    return exchange(counts.to(torch.int64), list(recv_splits), list(send_splits), group)
