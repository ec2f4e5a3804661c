"""All-to-all exchanges with uneven split sizes, differentiable: the backward of a dispatch is a combine.

``all_to_all_single`` sends rows[offsets_r : offsets_r + send_splits[r]] to rank r and receives
recv_splits[r] rows from rank r, stacked by source rank. The gradient of the received rows goes back along
the same routes reversed: an all-to-all with the two split lists swapped. The same code runs on gloo (CPU
processes) and NCCL (GPUs); split sizes are host ints (every rank must know how many rows to expect).

Empty sends are normal here (a rank whose tokens pick no expert of some rank, a rank with no tokens at all), and
NCCL's all-to-all with empty buffers is a known trap (a rank that sends and receives nothing may skip the call
the others wait in, or a zero-size buffer is rejected). On NCCL every exchange is therefore **guarded**: one
padding row travels in front of every block, so no split is 0 and no buffer empty, and the received padding rows
are dropped (:func:`pad_blocks`, :func:`unpad_blocks`): P rows more per exchange, the same rows arriving.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def pad_blocks(rows: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """rows [Σ splits, ...] split into blocks of ``splits`` -> [Σ splits + P, ...]: a zero row in front of each
    block (block r then holds splits[r] + 1 rows, never 0)."""
    blocks = rows.split(list(splits))
    zero = rows.new_zeros((1, *rows.shape[1:]))
    return torch.cat([piece for block in blocks for piece in (zero, block)])


def unpad_blocks(received: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """The inverse of :func:`pad_blocks`: [Σ splits + P, ...] of blocks of splits[r] + 1 rows -> [Σ splits, ...],
    the first row of every block dropped."""
    blocks = received.split([size + 1 for size in splits])
    return torch.cat([block[1:] for block in blocks])


def needs_guard(group=None) -> bool:
    """Whether exchanges over ``group`` are guarded against empty sends (NCCL; see the module docstring)."""
    return dist.get_backend(group) == "nccl"


def exchange(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group=None,
             guard: bool | None = None) -> torch.Tensor:
    """One uneven all-to-all, no autograd. rows [Σ send_splits, ...] -> [Σ recv_splits, ...] grouped by source.
    ``guard``: pad every block by one row (default :func:`needs_guard`: on NCCL; every rank must agree)."""
    if rows.shape[0] != sum(send_splits):
        raise ValueError(f"rows has {rows.shape[0]} rows but send_splits sum to {sum(send_splits)}")
    if guard if guard is not None else needs_guard(group):
        padded = exchange(pad_blocks(rows, send_splits), [size + 1 for size in recv_splits],
                          [size + 1 for size in send_splits], group, guard=False)
        return unpad_blocks(padded, recv_splits)
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
