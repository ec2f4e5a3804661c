"""Expert parallelism: the routed experts of one MoE layer spread over P ranks, tokens moved by all-to-all.

Every rank builds the same layer, then keeps its contiguous block of routed experts. On each rank:

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

from k3course.distributed.balancing import pooled_load, pooled_quantile_bias
from k3course.distributed.exchange import all_to_all, exchange, exchange_counts
from k3course.distributed.plan import (
    dedup_pairs,
    dispatch_permutation,
    expert_ranges,
    inverse_permutation,
    rank_of_expert,
    split_sizes,
)
from k3course.moe.balancing import expert_load, sign_rule_update
from k3course.moe.dispatch import sort_by_expert, unsort
from k3course.moe.experts import ACTIVATIONS, RoutedExperts
from k3course.moe.layers import MoE

_MODULE_STATE = frozenset(vars(nn.Module())) - {"training"}  # nn.Module's own bookkeeping, not layer settings


def local_experts(experts: RoutedExperts, start: int, end: int) -> RoutedExperts:
    """A bank holding experts [start, end) of ``experts``: gate_up [end − start, d, 2h], down [end − start, h, d]."""
    n, d_in, _ = experts.gate_up.shape
    if not 0 <= start < end <= n:
        raise ValueError(f"start, end must satisfy 0 <= start < end <= {n}, got {start}, {end}")
    activation = next(name for name, fn in ACTIVATIONS.items() if fn is experts.act)
    with torch.device("meta"):  # shapes only; the weights are the sliced copies below
        local = RoutedExperts(end - start, d_in, experts.hidden, activation, backend=experts.backend)
    local.gate_up = nn.Parameter(experts.gate_up.detach()[start:end].clone(), experts.gate_up.requires_grad)
    local.down = nn.Parameter(experts.down.detach()[start:end].clone(), experts.down.requires_grad)
    return local


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """starts[r] = Σ_{q<r} counts[q]. [P] -> [P]."""
    return counts.cumsum(0) - counts


class ExpertParallelMoE(MoE):
    """An :class:`~k3course.moe.MoE` / ``LatentMoE`` whose routed experts are split over the ranks of ``group``.

    Build it with :meth:`from_moe` from a layer built identically on every rank. Parameter names are the
    layer's own: ``experts.gate_up`` [E_r, w, 2h] and ``experts.down`` [E_r, h, w] hold this rank's experts
    ``local_expert_range`` = [start, end); everything else (router, bias, shared experts, W↓, W↑, norm) is the
    layer's tensor, replicated. Forward x [..., d] -> y [..., d], equal to the single-process layer on this
    rank's tokens. Ranks may hold different token counts (zero included) but must call forward, backward and
    :meth:`update_bias` together (they are collectives). ``dedup=True`` sends each token once per destination
    rank (not once per expert) plus a 4-byte index per slot; results are identical.
    After each forward ``last_traffic`` holds the bytes that this rank's tokens moved between ranks: dispatch
    (sent), combine (received back) and metadata (split sizes and dedup indices, sent).
    """

    def __init__(self, layer: MoE, group=None, dedup: bool = False, histogram_bins: int = 256):
        nn.Module.__init__(self)
        if not isinstance(layer, MoE) or isinstance(layer, ExpertParallelMoE):
            raise TypeError(f"layer must be an MoE or LatentMoE (not yet expert-parallel), got {type(layer).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE needs torch.distributed.init_process_group(...) first")
        for name, value in vars(layer).items():
            if name not in _MODULE_STATE:
                setattr(self, name, value.copy() if isinstance(value, (list, dict)) else value)
        for name, param in layer.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in layer.named_buffers(recurse=False):
            self.register_buffer(name, buffer.clone(), persistent=name not in layer._non_persistent_buffers_set)
        for name, child in layer.named_children():
            self.add_module(name, child)
        self.group, self.dedup, self.histogram_bins = group, dedup, histogram_bins
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.expert_ranges = expert_ranges(layer.n_routed, self.world_size)
        self.local_expert_range = self.expert_ranges[self.rank]
        self.experts = local_experts(layer.experts, *self.local_expert_range)
        self.last_traffic: dict[str, int] = {}
        self.last_exchange_seconds, self.time_exchanges = 0.0, False

    @classmethod
    def from_moe(cls, moe: MoE, group=None, dedup: bool = False, histogram_bins: int = 256) -> ExpertParallelMoE:
        """Wrap ``moe`` (built identically on every rank of ``group``); see the class docstring."""
        return cls(moe, group, dedup, histogram_bins)

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's routed-expert tensors (never all-reduced: each rank owns different experts)."""
        return list(self.experts.parameters())

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Router, shared experts and latent projections: the same on every rank, gradients to all-reduce."""
        local = {id(p) for p in self.experts.parameters()}
        return [p for p in self.parameters() if id(p) not in local]

    def expert_outputs(self, z: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """E_{idx_ti}(z_t) for every token-slot, the experts living on whichever rank owns them.

        z [m, w] (w = d, or ℓ for LatentMoE), expert_idx [m, k] (global expert ids) -> [m, k, w], slot order.
        Sets ``last_traffic`` and ``last_exchange_seconds`` (wall time in the exchanges, split-size exchange
        included; on CUDA exact only with ``time_exchanges = True``, which synchronises).
        """
        m, k = expert_idx.shape
        order = dispatch_permutation(expert_idx)  # [m k]: slots by expert, hence by destination rank
        started = self._clock(z)
        received, recv_counts, send_splits, recv_splits = self._dispatch(z, expert_idx, order)
        dispatched = self._clock(z)
        outputs = self._run_local_experts(received, recv_counts)  # [R, w], same order as received
        computed = self._clock(z)
        returned = all_to_all(outputs, send_splits, recv_splits, self.group)  # [m k, w] in dispatch order
        self.last_exchange_seconds = dispatched - started + self._clock(z) - computed
        self.last_traffic["combine"] = self._remote_bytes(returned, send_splits)  # this rank's slots, back
        return returned.index_select(0, inverse_permutation(order)).view(m, k, z.shape[1])

    def _dispatch(self, z: torch.Tensor, expert_idx: torch.Tensor, order: torch.Tensor):
        """Exchange split sizes, then send every slot's row to the rank owning its expert.

        -> (received [R, w] grouped by source rank then local expert, recv_counts [P, E_r] rows per
        (source, local expert), send_splits, recv_splits); sets ``last_traffic`` dispatch and metadata.
        """
        sizes = [end - start for start, end in self.expert_ranges]  # experts per rank
        local_size = sizes[self.rank]
        slot_counts = expert_load(expert_idx, self.n_routed)  # [n]
        recv_counts = exchange_counts(slot_counts, [local_size] * self.world_size, sizes, self.group)
        recv_counts = recv_counts.view(self.world_size, local_size)  # [P, E_r]: from source q for local expert e
        send_splits = split_sizes(expert_idx, self.n_routed, self.world_size).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        self.last_traffic = {"metadata": 8 * (self.n_routed - local_size)}
        if self.dedup:
            received = self._dispatch_dedup(z, expert_idx, order, send_splits, recv_splits)
        else:
            sent = z.index_select(0, order // expert_idx.shape[1])  # [m k, w]
            self.last_traffic["dispatch"] = self._remote_bytes(sent, send_splits)
            received = all_to_all(sent, recv_splits, send_splits, self.group)  # [R, w]
        return received, recv_counts, send_splits, recv_splits

    def _clock(self, like: torch.Tensor) -> float:
        """perf_counter, after a CUDA synchronisation when ``time_exchanges`` is set and ``like`` is on a GPU."""
        if self.time_exchanges and like.is_cuda:
            torch.cuda.synchronize(like.device)
        return time.perf_counter()

    @torch.no_grad()
    def update_bias(self) -> bool:
        """:meth:`MoE.update_bias` on the tokens of ALL ranks since the last update; every rank gets the same bias.

        quantile: read off the all-reduced margin histograms (``histogram_bins`` bins, default 256);
        sign: b ← b − γ sign(load − mean load), load all-reduced. A collective: call it on every rank together
        (a rank that recorded no token takes part with empty statistics).
        """
        if not self.training or self.balancing not in ("quantile", "sign"):
            return False
        statistics = self.balancing_statistics()
        self.reset_statistics()
        tokens = torch.tensor(statistics["tokens"], device=self.bias.device)
        dist.all_reduce(tokens, group=self.group)
        if int(tokens) == 0:
            return False
        if self.balancing == "quantile":
            new_bias = pooled_quantile_bias(statistics["scores"], self.bias, self.top_k, self.histogram_bins,
                                            self.group)
        else:
            new_bias = sign_rule_update(self.bias, pooled_load(statistics["load"], self.group), self.gamma)
        self.bias.copy_(new_bias)
        return True

    def _dispatch_dedup(self, z: torch.Tensor, expert_idx: torch.Tensor, order: torch.Tensor,
                        send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Send each (destination rank, token) pair once, plus per slot the index of its pair's row.

        The receiver expands pairs to slots, giving the same [R, w] rows as the naive dispatch.
        """
        m, device = z.shape[0], z.device
        pairs, slot_pair = dedup_pairs(expert_idx, self.n_routed, self.world_size)  # [R_pairs], [m k]
        pair_counts = torch.bincount(pairs // max(m, 1), minlength=self.world_size)  # [P]
        pair_recv = exchange_counts(pair_counts, [1] * self.world_size, [1] * self.world_size, self.group)
        pair_send, pair_recv = pair_counts.tolist(), pair_recv.tolist()
        sent = z.index_select(0, pairs % max(m, 1))  # [R_pairs, w]
        owner = rank_of_expert(self.n_routed, self.world_size).to(device)[expert_idx.reshape(-1)[order]]
        index = (slot_pair[order] - _exclusive_cumsum(pair_counts)[owner]).to(torch.int32)  # row within the block
        rows = all_to_all(sent, pair_recv, pair_send, self.group)
        recv_index = exchange(index, recv_splits, send_splits, self.group).to(torch.int64)
        source = torch.repeat_interleave(torch.arange(self.world_size, device=device),
                                         torch.tensor(recv_splits, device=device))
        self.last_traffic["dispatch"] = self._remote_bytes(sent, pair_send)
        self.last_traffic["metadata"] += 8 * (self.world_size - 1) + self._remote_bytes(index, send_splits)
        start = _exclusive_cumsum(torch.tensor(pair_recv, device=device))
        return rows.index_select(0, recv_index + start[source])

    def _run_local_experts(self, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by (source, local expert) -> regrouped by expert -> local experts -> original order.

        received [R, w], recv_counts [P, E_r] -> [R, w].
        """
        local_size = recv_counts.shape[1]
        expert_of_row = torch.repeat_interleave(
            torch.arange(local_size, device=received.device).repeat(self.world_size), recv_counts.reshape(-1))
        local_order, offsets = sort_by_expert(expert_of_row[:, None], local_size)
        outputs = self.experts(received.index_select(0, local_order), offsets)
        return unsort(outputs, local_order)

    def _remote_bytes(self, rows: torch.Tensor, splits: list[int]) -> int:
        """Bytes of ``rows`` split by ``splits`` that cross to or from other ranks (this rank's own block is a copy)."""
        row_bytes = rows.element_size() * math.prod(rows.shape[1:])
        return (sum(splits) - splits[self.rank]) * row_bytes
