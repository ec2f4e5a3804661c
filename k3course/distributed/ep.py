"""Expert parallelism: the routed experts of an MoE layer spread over P ranks, tokens moved by all-to-all.

Every rank builds the same layer; :func:`parallelize_experts` keeps the rank's contiguous block of routed experts
in the layer's own ``experts`` bank and gives the layer an :class:`AllToAllDispatch`. On each rank:

    route locally (replicated router)      idx, p = TopK(s + b);  z = x (MoE) or x W↓ (LatentMoE, ℓ-wide rows)
    exchange split sizes                   each rank learns how many rows it receives per (source, expert)
    dispatch  (all_to_all_single)          z[order // k] → the ranks owning the experts
    local grouped experts                  E_j(z) for the local experts j, rows regrouped by expert
    combine   (all_to_all_single)          outputs back along the reverse routes
    weighted sum                           y = shared(x) + Σ_i p_i E_i(z)   (or RMSNorm(·) W↑), token order

Both exchanges are autograd Functions whose backward is the reverse exchange, so ∂E_j arrives at the rank
holding expert j from every rank's tokens, and the replicated parameters (router, shared experts, W↓, W↑,
norm) get this rank's contribution only: sum (or average) them across ranks as DDP does.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from k3course.distributed.balancing import all_reduce_over
from k3course.distributed.exchange import all_to_all, exchange, exchange_counts
from k3course.distributed.plan import (
    dedup_pairs,
    dispatch_permutation,
    expert_ranges,
    inverse_permutation,
    rank_of_expert,
    split_sizes,
)
from k3course.guards import is_number
from k3course.moe.balancing import HISTOGRAM_BINS, expert_load, histogram_quantile_bias
from k3course.moe.dispatch import sort_by_expert, unsort
from k3course.moe.experts import RoutedExperts
from k3course.moe.layers import MoE
from k3course.parts import part


def parallelize_experts(module: nn.Module, group=None, dedup: bool = False,
                        histogram_bins: int = HISTOGRAM_BINS, pool_group=None) -> nn.Module:
    """Spread the routed experts of every MoE / LatentMoE in ``module`` (itself included) over the ranks of
    ``group``, in place; returns ``module``.

    ``module`` must be built identically on every rank (same seed), and parallelised before its optimizer is
    made. Each layer keeps, in its own bank under the same parameter names, this rank's block [start, end) of
    routed experts (``experts.gate_up`` [E_r, w, 2h], ``experts.down`` [E_r, h, w]); router, bias, shared
    experts, W↓, W↑ and the norm stay whole on every rank (replicated). The layer's dispatcher becomes an
    :class:`AllToAllDispatch` (``dedup``: send each token once per destination rank; ``histogram_bins``: the
    bins of the pooled quantile step; ``pool_group``: the ranks whose routing statistics the bias update pools,
    default ``group``: every rank that routes, a superset of ``group``, e.g. all ranks of a 2-D mesh,
    :func:`k3course.distributed.parallelize`). Forward, backward, ``load_statistics`` and ``update_bias`` are
    then collectives: every rank calls them together, with its own tokens (zero included).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    if not layers:
        raise TypeError(f"module must be or contain an MoE / LatentMoE, {type(module).__name__} holds none")
    if expert_parallel_layers(module):
        raise ValueError("module: its experts are already expert-parallel")
    for layer in layers:
        dispatcher = AllToAllDispatch(layer.n_routed_experts, group, dedup, histogram_bins, pool_group,
                                      layer.experts.kernels)
        keep_experts(layer.experts, *dispatcher.local_expert_range)
        layer.dispatcher = dispatcher
        layer.balancer.pooled = None  # counts pooled by the old dispatcher: this process's only
    return module


def expert_parallel_layers(module: nn.Module) -> list[MoE]:
    """The MoE layers of ``module`` whose experts are spread over ranks (empty on one process)."""
    return [m for m in module.modules() if isinstance(m, MoE) and isinstance(m.dispatcher, AllToAllDispatch)]


def keep_experts(experts: RoutedExperts, start: int, end: int) -> None:
    """Keep experts [start, end) of the bank, in place: gate_up [n, w, 2h] -> [end − start, w, 2h], down
    [n, h, w] -> [end − start, h, w], under the same names (new parameters holding copies of the slices)."""
    n = experts.gate_up.shape[0]
    if not 0 <= start < end <= n:
        raise ValueError(f"start, end must satisfy 0 <= start < end <= {n}, got {start}, {end}")
    for name in ("gate_up", "down"):
        param = getattr(experts, name)
        setattr(experts, name, nn.Parameter(param.detach()[start:end].clone(), param.requires_grad))


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """starts[r] = Σ_{q<r} counts[q]. [P] -> [P]."""
    return counts.cumsum(0) - counts


def _host_splits(send: torch.Tensor, recv: torch.Tensor) -> tuple[list[int], list[int]]:
    """Send and receive split sizes [P], [P] (device tensors) as host ints, in one read: ``all_to_all_single``
    takes its splits as host lists, so each exchange plan costs exactly one device→host copy."""
    both = torch.cat([send, recv]).tolist()  # [2P]
    return both[: send.numel()], both[send.numel():]


class AllToAllDispatch:
    """How an MoE reaches routed experts spread over the ranks of ``group``: the contract of
    :class:`k3course.moe.LocalDispatch`, with collectives.

    n_routed_experts experts in contiguous blocks, ``expert_ranges`` [(start_r, end_r)] for every rank;
    ``local_expert_range`` is this rank's (the experts its bank holds). ``expert_outputs`` equals the
    single-process layer on this rank's tokens; ``pool_counts`` all-reduces M and the load over
    ``pool_group`` (default ``group``: the ranks that route, which may be more than those sharing the experts);
    ``quantile_bias`` reads the quantile off margin histograms all-reduced there (``histogram_bins`` bins, made by
    the MoE's kernel backend ``kernels``: :func:`~k3course.moe.balancing.margin_histogram_for`).
    ``dedup=True`` sends each token once per destination rank (not once per expert) plus a 4-byte index per
    slot; results are identical. After each forward ``last_traffic`` holds the bytes that this rank's tokens
    moved between ranks: dispatch (sent), combine (received back) and metadata (split sizes and dedup
    indices, sent); ``last_exchange_seconds`` the wall time in the exchanges (on CUDA exact only with
    ``time_exchanges = True``, which synchronises).
    """

    def __init__(self, n_routed_experts: int, group=None, dedup: bool = False, histogram_bins: int = HISTOGRAM_BINS,
                 pool_group=None, kernels: str = "auto"):
        if not dist.is_initialized():
            raise RuntimeError("expert parallelism needs torch.distributed.init_process_group(...) first")
        if not is_number(histogram_bins) or histogram_bins < 1:
            raise ValueError(f"histogram_bins must be a positive int, got {histogram_bins!r}")
        self.n_routed_experts, self.group, self.dedup = n_routed_experts, group, dedup
        self.pool_group = group if pool_group is None else pool_group
        self.histogram_bins, self.kernels = histogram_bins, kernels
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.expert_ranges = expert_ranges(n_routed_experts, self.world_size)
        self.local_expert_range = self.expert_ranges[self.rank]
        self.last_traffic: dict[str, int] = {}
        self.last_exchange_seconds, self.time_exchanges = 0.0, False

    def expert_outputs(self, experts: RoutedExperts, z: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """E_{idx_ti}(z_t) for every token-slot, the experts living on whichever rank owns them.

        experts: this rank's bank; z [m, w] (w = d, or ℓ for LatentMoE), expert_idx [m, k] (global expert ids)
        -> [m, k, w], slot order. Sets ``last_traffic`` and ``last_exchange_seconds`` (split-size exchange
        included).
        """
        m, k = expert_idx.shape
        order = dispatch_permutation(expert_idx)  # [m k]: slots by expert, hence by destination rank
        started = self._clock(z)
        received, recv_counts, send_splits, recv_splits = self._dispatch(z, expert_idx, order)
        dispatched = self._clock(z)
        outputs = self._run_local_experts(experts, received, recv_counts)  # [R, w], same order as received
        computed = self._clock(z)
        returned = self._all_to_all(outputs, send_splits, recv_splits)  # [m k, w] in dispatch order
        self.last_exchange_seconds = dispatched - started + self._clock(z) - computed
        self.last_traffic["combine"] = self._remote_bytes(returned, send_splits)  # this rank's slots, back
        return returned.index_select(0, inverse_permutation(order)).view(m, k, z.shape[1])

    def pool_counts(self, tokens: int, load: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(M, load [n]) summed over the ranks: one all-reduce of [load, tokens] (integers: exact and equal on
        every rank)."""
        packed = torch.cat([load, load.new_tensor([tokens])])  # [n + 1] int64
        dist.all_reduce(packed, group=self.pool_group)
        return int(packed[-1]), packed[:-1]

    def quantile_bias(self, scores: torch.Tensor, bias: torch.Tensor, k: int, tokens: int) -> torch.Tensor:
        """The quantile step on the M = ``tokens`` tokens of all ranks (M from :meth:`pool_counts`) from this
        rank's scores [m_r, n]: :func:`~k3course.moe.balancing.histogram_quantile_bias` with all-reduces, within
        one bin width of the exact step on the concatenated scores and equal on every rank."""
        pooled = all_reduce_over(self.pool_group)
        return histogram_quantile_bias(scores, bias, k, self.histogram_bins, pooled, tokens, self.kernels)

    def _dispatch(self, z: torch.Tensor, expert_idx: torch.Tensor, order: torch.Tensor):
        """Exchange split sizes, then send every slot's row to the rank owning its expert.

        -> (received [R, w] grouped by source rank then local expert, recv_counts [P, E_r] rows per
        (source, local expert), send_splits, recv_splits); sets ``last_traffic`` dispatch and metadata.
        """
        sizes = [end - start for start, end in self.expert_ranges]  # experts per rank
        local_size = sizes[self.rank]
        slot_counts = expert_load(expert_idx, self.n_routed_experts)  # [n]
        recv_counts = exchange_counts(slot_counts, [local_size] * self.world_size, sizes, self.group)
        recv_counts = recv_counts.view(self.world_size, local_size)  # [P, E_r]: from source q for local expert e
        send_splits, recv_splits = _host_splits(split_sizes(expert_idx, self.n_routed_experts, self.world_size),
                                                recv_counts.sum(1))
        self.last_traffic = {"metadata": 8 * (self.n_routed_experts - local_size)}
        if self.dedup:
            received = self._dispatch_dedup(z, expert_idx, order, send_splits, recv_splits)
        else:
            sent = z.index_select(0, order // expert_idx.shape[1])  # [m k, w]
            self.last_traffic["dispatch"] = self._remote_bytes(sent, send_splits)
            received = self._all_to_all(sent, recv_splits, send_splits)  # [R, w]
        return received, recv_counts, send_splits, recv_splits

    def _all_to_all(self, rows: torch.Tensor, recv_splits: list[int], send_splits: list[int]) -> torch.Tensor:
        """:func:`~k3course.distributed.exchange.all_to_all` in this dispatch's group: the one place the layer calls
        it, through the parts registry (a learner's own, lesson 16)."""
        return part("all_to_all", all_to_all)(rows, recv_splits, send_splits, self.group)

    def _clock(self, like: torch.Tensor) -> float:
        """perf_counter, after a CUDA synchronisation when ``time_exchanges`` is set and ``like`` is on a GPU."""
        if self.time_exchanges and like.is_cuda:
            torch.cuda.synchronize(like.device)
        return time.perf_counter()

    def _dispatch_dedup(self, z: torch.Tensor, expert_idx: torch.Tensor, order: torch.Tensor,
                        send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Send each (destination rank, token) pair once, plus per slot the index of its pair's row.

        The receiver expands pairs to slots, giving the same [R, w] rows as the naive dispatch.
        """
        m, device = z.shape[0], z.device
        pairs, slot_pair = dedup_pairs(expert_idx, self.n_routed_experts, self.world_size)  # [R_pairs], [m k]
        pair_counts = torch.bincount(pairs // max(m, 1), minlength=self.world_size)  # [P]
        pair_recv = exchange_counts(pair_counts, [1] * self.world_size, [1] * self.world_size, self.group)
        pair_send, pair_recv = _host_splits(pair_counts, pair_recv)
        sent = z.index_select(0, pairs % max(m, 1))  # [R_pairs, w]
        owner = rank_of_expert(self.n_routed_experts, self.world_size, device)[expert_idx.reshape(-1)[order]]
        index = (slot_pair[order] - _exclusive_cumsum(pair_counts)[owner]).to(torch.int32)  # row within the block
        rows = self._all_to_all(sent, pair_recv, pair_send)
        recv_index = exchange(index, recv_splits, send_splits, self.group).to(torch.int64)
        source = torch.repeat_interleave(torch.arange(self.world_size, device=device),
                                         torch.tensor(recv_splits, device=device))
        self.last_traffic["dispatch"] = self._remote_bytes(sent, pair_send)
        self.last_traffic["metadata"] += 8 * (self.world_size - 1) + self._remote_bytes(index, send_splits)
        start = _exclusive_cumsum(torch.tensor(pair_recv, device=device))
        return rows.index_select(0, recv_index + start[source])

    def _run_local_experts(self, experts: RoutedExperts, received: torch.Tensor,
                           recv_counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by (source, local expert) -> regrouped by expert -> local experts -> original order.

        received [R, w], recv_counts [P, E_r] -> [R, w].
        """
        local_size = recv_counts.shape[1]
        expert_of_row = torch.repeat_interleave(
            torch.arange(local_size, device=received.device).repeat(self.world_size), recv_counts.reshape(-1))
        local_order, offsets = sort_by_expert(expert_of_row[:, None], local_size)
        outputs = experts(received.index_select(0, local_order), offsets)
        return unsort(outputs, local_order)

    def _remote_bytes(self, rows: torch.Tensor, splits: list[int]) -> int:
        """Bytes of ``rows`` split by ``splits`` that cross to or from other ranks (this rank's own block is a copy)."""
        row_bytes = rows.element_size() * math.prod(rows.shape[1:])
        return (sum(splits) - splits[self.rank]) * row_bytes
