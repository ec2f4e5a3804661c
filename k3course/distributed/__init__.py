"""Expert parallelism over torch.distributed (chapter 13): dispatch and combine by all-to-all around each MoE's
own expert bank, balancing statistics pooled over ranks, and the data-parallel rest of a training step; FSDP2 ×
EP on a 2-D mesh (:func:`parallelize`) with sharded checkpoints (:mod:`.sharded_checkpoint`, DCP)."""

from k3course.distributed.data_parallel import (
    average_gradients,
    average_over_ranks,
    clip_global_grad_norm,
    expert_group,
    gather_state_dict,
    pool_group,
)
from k3course.distributed.ep import AllToAllDispatch, expert_parallel_layers, keep_experts, parallelize_experts
from k3course.distributed.exchange import all_to_all, exchange, exchange_counts
from k3course.distributed.fsdp import make_mesh, parallelize
from k3course.distributed.launch import RankFailed, join_group, leave_group, run_ranks
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
from k3course.distributed.sharded_checkpoint import save_pretrained

__all__ = ["AllToAllDispatch", "RankFailed", "all_to_all", "average_gradients", "average_over_ranks",
           "clip_global_grad_norm", "combine", "dedup_pairs", "dispatch_permutation", "exchange", "exchange_counts",
           "expert_group", "expert_parallel_layers", "expert_ranges", "gather_state_dict",
           "inverse_permutation", "join_group", "keep_experts", "leave_group", "make_mesh", "parallelize",
           "parallelize_experts", "pool_group", "rank_of_expert", "run_ranks", "save_pretrained",
           "split_sizes", "traffic_bytes"]
