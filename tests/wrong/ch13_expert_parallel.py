"""Plausible wrong answers for chapter 13."""

import torch
import torch.distributed as dist


def splits_count_tokens_not_slots(expert_idx, n_experts, world_size):
    """One per (token, rank) pair: what deduplication sends, not the slots."""
    block = -(-n_experts // world_size)
    owner = expert_idx // block
    pairs = torch.unique(owner * expert_idx.shape[0] + torch.arange(expert_idx.shape[0])[:, None])
    return torch.bincount(pairs // expert_idx.shape[0], minlength=world_size)


def splits_with_equal_blocks_rounded_up(expert_idx, n_experts, world_size):
    """Blocks of ceil(n / P) experts: wrong whenever P does not divide n."""
    block = -(-n_experts // world_size)
    return torch.bincount((expert_idx // block).reshape(-1), minlength=world_size)


def splits_per_expert(expert_idx, n_experts, world_size):
    return torch.bincount(expert_idx.reshape(-1), minlength=n_experts)


def permutation_sorted_descending(expert_idx):
    return torch.sort(expert_idx.reshape(-1), descending=True, stable=True).indices


def permutation_token_major(expert_idx):
    """Slots grouped by token, then expert: not contiguous per expert."""
    m, k = expert_idx.shape
    within = torch.sort(expert_idx, dim=1, stable=True).indices
    return (torch.arange(m)[:, None] * k + within).reshape(-1)


def permutation_sorted_by_token_index_last(expert_idx):
    """Sort on expert · m − token: experts in order, but tokens reversed within an expert."""
    m, k = expert_idx.shape
    key = expert_idx * m - torch.arange(m)[:, None]
    return torch.sort(key.reshape(-1), stable=True).indices


def inverse_is_the_permutation(order):
    return order.clone()


def inverse_reversed(order):
    return order.flip(0)


def combine_without_unsorting(returned, order, weights):
    m, k = weights.shape
    return torch.einsum("mk,mkw->mw", weights, returned.view(m, k, -1))


def combine_gathers_with_order(returned, order, weights):
    """Uses the permutation where its inverse belongs."""
    m, k = weights.shape
    return torch.einsum("mk,mkw->mw", weights, returned[order].view(m, k, -1))


def combine_forgets_the_weights(returned, order, weights):
    m, k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return returned[inverse].view(m, k, -1).sum(1)


def _unsorted_slots(returned, order, m, k):
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return returned[inverse].view(m, k, -1)  # [m, k, w]


def combine_in_the_weights_dtype(returned, order, weights):
    """weights[..., None] * slots: type promotion makes bf16 outputs with fp32 weights come back fp32."""
    m, k = weights.shape
    return (weights.unsqueeze(-1) * _unsorted_slots(returned, order, m, k)).sum(1)


def combine_weighted_mean(returned, order, weights):
    """Divides by the weights' sum: right only when each token's weights already sum to 1."""
    m, k = weights.shape
    total = torch.einsum("mk,mkw->mw", weights.to(returned.dtype), _unsorted_slots(returned, order, m, k))
    return total / weights.sum(-1, keepdim=True).to(returned.dtype)

def _exchange(rows, output_splits, input_splits):
    """all_to_all_single into a buffer of Σ output_splits rows."""
    received = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), output_splits, input_splits)
    return received


class _SplitsSwapped(torch.autograd.Function):
    """Forward hands all_to_all_single the send splits as the output splits and the receive splits as the input."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits):
        ctx.splits = recv_splits, send_splits
        received = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), send_splits, recv_splits)
        return received

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        return _exchange(grad, send_splits, recv_splits), None, None


class _BackwardSameSplits(torch.autograd.Function):
    """Backward repeats the forward's exchange instead of reversing it."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits):
        ctx.splits = recv_splits, send_splits
        return _exchange(rows, recv_splits, send_splits)

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits), None, None


class _BackwardIdentity(torch.autograd.Function):
    """Backward passes the gradient through unchanged, as if the exchange moved nothing."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits):
        return _exchange(rows, recv_splits, send_splits)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def all_to_all_splits_swapped(rows, recv_splits, send_splits, group=None):
    return _SplitsSwapped.apply(rows, recv_splits, send_splits)


def all_to_all_backward_same_splits(rows, recv_splits, send_splits, group=None):
    return _BackwardSameSplits.apply(rows, recv_splits, send_splits)


def all_to_all_backward_identity(rows, recv_splits, send_splits, group=None):
    return _BackwardIdentity.apply(rows, recv_splits, send_splits)


def all_to_all_without_autograd(rows, recv_splits, send_splits, group=None):
    """The forward alone: the result has no path back to rows."""
    return _exchange(rows.detach(), recv_splits, send_splits)



class _Exchange(torch.autograd.Function):
    """The right exchange, with a flag for each thing a variant leaves out."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits, group, group_in_backward, contiguous_rows, contiguous_grad):
        ctx.splits, ctx.group = (recv_splits, send_splits), group if group_in_backward else None
        ctx.contiguous_grad = contiguous_grad
        received = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous() if contiguous_rows else rows, recv_splits, send_splits,
                               group=group)
        return received

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        grad_rows = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_rows, grad.contiguous() if ctx.contiguous_grad else grad, send_splits,
                               recv_splits, group=ctx.group)
        return grad_rows, None, None, None, None, None, None


def all_to_all_on_the_default_group(rows, recv_splits, send_splits, group=None):
    """Takes group and never passes it on: the exchange runs over every rank of the default group."""
    return _Exchange.apply(rows, list(recv_splits), list(send_splits), None, False, True, True)


def all_to_all_backward_on_the_default_group(rows, recv_splits, send_splits, group=None):
    """The forward on ``group``, the backward on the default group (the group is not kept for it)."""
    return _Exchange.apply(rows, list(recv_splits), list(send_splits), group, False, True, True)


def all_to_all_rows_as_they_come(rows, recv_splits, send_splits, group=None):
    """Hands all_to_all_single the rows as they come: a strided view (a slice, a transpose) is not contiguous."""
    return _Exchange.apply(rows, list(recv_splits), list(send_splits), group, True, False, True)


def all_to_all_gradient_as_it_comes(rows, recv_splits, send_splits, group=None):
    """Hands all_to_all_single the upstream gradient as it comes: autograd can pass a non-contiguous one."""
    return _Exchange.apply(rows, list(recv_splits), list(send_splits), group, True, True, False)


def all_to_all_with_torchs_own(rows, recv_splits, send_splits, group=None):
    """torch.distributed.nn.functional.all_to_all_single: torch's differentiable exchange, not one written here."""
    from torch.distributed.nn.functional import all_to_all_single

    received = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    return all_to_all_single(received, rows.contiguous(), list(recv_splits), list(send_splits),
                             group=group or dist.group.WORLD)

WRONG = {
    "13.all_to_all": [all_to_all_splits_swapped, all_to_all_backward_same_splits, all_to_all_backward_identity,
                      all_to_all_without_autograd, all_to_all_on_the_default_group,
                      all_to_all_backward_on_the_default_group, all_to_all_rows_as_they_come,
                      all_to_all_gradient_as_it_comes, all_to_all_with_torchs_own],
    "13.split_sizes": [splits_count_tokens_not_slots, splits_with_equal_blocks_rounded_up, splits_per_expert],
    "13.dispatch_permutation": [permutation_sorted_descending, permutation_token_major,
                                permutation_sorted_by_token_index_last],
    "13.inverse_permutation": [inverse_is_the_permutation, inverse_reversed],
    "13.combine": [combine_without_unsorting, combine_gathers_with_order, combine_forgets_the_weights,
                   combine_in_the_weights_dtype, combine_weighted_mean],
}
