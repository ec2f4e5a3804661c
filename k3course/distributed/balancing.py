"""Load balancing across ranks: every rank computes the same bias from statistics pooled by all-reduce.

quantile (K3): :func:`k3course.moe.balancing.histogram_quantile_bias` with the reduction :func:`all_reduce_over`
returns: each rank's margins s_tj − α_t are histogrammed per expert over edges all ranks agree on (from the
all-reduced min and max), the histograms are summed, and b̂_j = −(the (q+1)-th largest margin of expert j) is
read off the pooled histogram with q = ⌊M k / n⌋, M the tokens of all ranks.
sign rule (DeepSeek-V3): b ← b − γ sign(load − mean load) with load summed over the ranks
(:meth:`k3course.distributed.AllToAllDispatch.pool_counts`).
Integer counts are summed exactly and the edges are the same floats everywhere, so the biases are identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k3course.moe.balancing import Reduction

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce_over(group=None) -> Reduction:
    """The reduction over the ranks of ``group``: reduce(tensor, "sum" | "max") all-reduces the tensor in place
    and returns it (a collective: every rank calls it with a tensor of the same shape)."""

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        dist.all_reduce(tensor, op=_OPS[op], group=group)
        return tensor

    return reduce
