"""Expert parallelism over torch.distributed (chapter 13): dispatch and combine by all-to-all, balancing and
training across ranks."""

from k3course.distributed.ep import ExpertParallelMoE
from k3course.distributed.exchange import all_to_all, exchange, exchange_counts
from k3course.distributed.launch import RankFailed, run_ranks
from k3course.distributed.plan import (
    combine,
    dedup_pairs,
    dispatch_permutation,
    expert_ranges,
    inverse_permutation,
    rank_of_expert,
    split_sizes,
    traffic_bytes,
)

__all__ = ["ExpertParallelMoE", "RankFailed", "all_to_all", "combine", "dedup_pairs", "dispatch_permutation",
           "exchange", "exchange_counts", "expert_ranges", "inverse_permutation", "rank_of_expert", "run_ranks",
           "split_sizes", "traffic_bytes"]
