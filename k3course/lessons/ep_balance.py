"""The balance simulation of lesson 13: how evenly a training MoE's token-slots spread over experts (and so over
the ranks that hold them), step by step, without balancing and with a balancing rule.

An MoE layer alone is trained with Adam on a regression target; the inputs share an offset that makes a few
experts popular, as real hidden states do. After every step the per-expert load is recorded and, when the layer
balances, its bias is updated. The loads size what expert parallelism waits for (the busiest rank) and what a
capacity factor would drop (:func:`k3course.distributed.cost.capacity_drop_fraction`).
"""

from __future__ import annotations

import torch

from k3course.lessons.fit import fit
from k3course.moe import MoE


def expert_loads(balancing: str, steps: int = 40, d: int = 32, n: int = 32, k: int = 4, tokens: int = 512,
                 offset: float = 0.8, seed: int = 0) -> torch.Tensor:
    """[steps, n] int64: the token-slots each expert received at each step of training an MoE(d, n, k) (expert
    width d/2, Adam lr 3e-3) to map x to x·T for a fixed random T, on ``tokens`` inputs x ~ N(offset, 1) a step;
    ``balancing`` "none", "aux_loss", "sign" or "quantile" (bias updated after each step). Each row sums to
    tokens · k."""
    generator = torch.Generator().manual_seed(seed)
    layer = MoE(d, n, k, expert_dim=d // 2, balancing=balancing, generator=generator).train()
    target = torch.randn(d, d, generator=generator) / d**0.5
    loads = []

    def loss_at(step: int) -> torch.Tensor:
        x = torch.randn(tokens, d, generator=generator) + offset  # a shared offset: some experts are favoured
        return (layer(x) - x @ target).square().mean()

    def balance(step: int) -> None:
        loads.append(layer.balancing_statistics()["load"].clone())
        layer.update_bias()

    fit(torch.optim.Adam(layer.parameters(), lr=3e-3), steps, loss_at, schedule_kind="constant", after_step=balance)
    return torch.stack(loads)
