"""The dispatch plan of expert parallelism, as plain tensor functions (no communication).

P ranks own contiguous blocks of the n routed experts: rank r holds experts [start_r, end_r), the first
n mod P ranks one more than the others. For m tokens with k experts each there are m·k token-slots, slot
s = t·k + i holding token t's i-th expert. Sorting the slots by expert (stable) also sorts them by
destination rank, so one permutation gives the dispatch order and the split sizes are per-rank slot counts:

    order      = argsort_stable(expert_idx.flatten())          rows sent: z[order // k]
    splits[r]  = #{slots s : start_r <= expert(s) < end_r}
    inverse    = order⁻¹                                       out_slots[s] = returned[inverse[s]]
    y_t        = Σ_i p_ti · out_slots[t·k + i]                 the combine

With deduplication a token is sent once per destination rank instead of once per expert: the rows are the
distinct (rank, token) pairs, and a small index per slot tells the receiver which row each slot reads.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from k3course.guards import is_number


def expert_ranges(n_experts: int, world_size: int) -> list[tuple[int, int]]:
    """[start_r, end_r) of each rank's contiguous block of experts; sizes ⌊n/P⌋ + (r < n mod P)."""
    if not is_number(world_size) or not 1 <= world_size <= n_experts:
        raise ValueError(f"world_size must be an int in [1, n_experts = {n_experts}] (every rank holds at least "
                         f"one expert), got {world_size!r}")
    base, extra = divmod(n_experts, world_size)
    sizes = [base + (r < extra) for r in range(world_size)]
    ends = list(accumulate(sizes))
    return [(end - size, end) for size, end in zip(sizes, ends)]


def rank_of_expert(n_experts: int, world_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """owner[j] = the rank whose block holds expert j. -> [n] int64 on ``device`` (made there: no host copy)."""
    ends = torch.tensor([end for _, end in expert_ranges(n_experts, world_size)], device=device)  # [P]
    return torch.bucketize(torch.arange(n_experts, device=device), ends, right=True)


def split_sizes(expert_idx: torch.Tensor, n_experts: int, world_size: int) -> torch.Tensor:
    """splits[r] = token-slots this rank sends to rank r. expert_idx [m, k] -> [P] int64 (sums to m·k)."""
    owner = rank_of_expert(n_experts, world_size, expert_idx.device)
    return torch.bincount(owner[expert_idx.reshape(-1)], minlength=world_size)


def dispatch_permutation(expert_idx: torch.Tensor) -> torch.Tensor:
    """order[r] = the slot sent as row r: slots sorted by expert, stable (hence by rank, then expert, then token).

    expert_idx [m, k] -> order [m k] int64. The token of row r is order[r] // k.
    """
    if expert_idx.dim() != 2:
        raise ValueError(f"expert_idx must have shape [m, k], got {tuple(expert_idx.shape)}")
    return torch.sort(expert_idx.reshape(-1), stable=True).indices


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inverse[order[r]] = r, so rows[inverse] puts rows sent in ``order`` back in slot order. [N] -> [N]."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def combine(returned: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y_t = Σ_i p_ti · returned[inverse[t·k + i]]: undo the dispatch order and take the weighted sum.

    returned [m k, w] (expert outputs in dispatch order), order [m k], weights [m, k] -> [m, w].
    """
    m, k = weights.shape
    out_slots = returned.index_select(0, inverse_permutation(order)).view(m, k, -1)  # [m, k, w]
    return torch.einsum("mk,mkw->mw", weights.to(returned.dtype), out_slots)


def dedup_pairs(expert_idx: torch.Tensor, n_experts: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (destination rank, token) pairs, sorted by rank then token, and each slot's pair.

    key = rank(expert) · m + token;  pairs = sorted distinct keys;  slot_pair[s] = position of slot s's key.
    expert_idx [m, k] -> (pairs [R] int64 with rank = pairs // m, token = pairs % m; slot_pair [m k] int64).
    """
    m = expert_idx.shape[0]
    owner = rank_of_expert(n_experts, world_size, expert_idx.device)
    token = torch.arange(m, device=expert_idx.device)[:, None]
    keys = (owner[expert_idx] * m + token).reshape(-1)  # [m k]
    pairs, slot_pair = torch.unique(keys, sorted=True, return_inverse=True)
    return pairs, slot_pair


def traffic_bytes(expert_idx: torch.Tensor, n_experts: int, world_size: int, rank: int, width: int,
                  value_bytes: int, dedup: bool = False, index_bytes: int = 4, count_bytes: int = 8) -> dict:
    """Bytes that this rank's tokens move between ranks in one forward of an expert-parallel layer (accounting).

    dispatch: w·b per remote slot (naive) or per remote distinct (rank, token) pair (dedup), sent;
    combine:  w·b per remote slot (each expert output comes back on its own), received;
    metadata: the split-size exchange, count_bytes per expert of another rank (and per other rank with dedup,
              whose pair counts travel too), plus index_bytes per remote slot with dedup (which pair it reads).
    expert_idx [m, k] -> {"dispatch", "combine", "metadata"} in bytes.
    """
    owner = rank_of_expert(n_experts, world_size, expert_idx.device)
    remote_slots = int((owner[expert_idx] != rank).sum())
    row = width * value_bytes
    remote_experts = n_experts - int((owner == rank).sum())
    metadata = count_bytes * remote_experts
    if dedup:
        pairs, _ = dedup_pairs(expert_idx, n_experts, world_size)
        remote_rows = int((pairs // max(expert_idx.shape[0], 1) != rank).sum())
        metadata += count_bytes * (world_size - 1) + index_bytes * remote_slots
    else:
        remote_rows = remote_slots
    return {"dispatch": remote_rows * row, "combine": remote_slots * row, "metadata": metadata}
