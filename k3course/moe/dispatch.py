"""Sort-based dispatch: group token-slots by expert, run each expert's GEMM on a contiguous block, unsort.

For m tokens with k experts each there are m·k token-slots; slot s = t·k + i holds token t's i-th expert.
``sort_by_expert`` gives the permutation that sorts slots by expert (stable, so tokens stay in order within
an expert) and each expert's block end; ``grouped_mm`` multiplies every block by its expert's weight;
``unsort`` applies the inverse permutation. Behind ``grouped_mm``'s ``impl`` (the model's kernel backend,
:func:`k3course.kernels.kernel_backend`, resolved by :func:`grouped_mm_path`) sit a per-expert loop,
``torch._grouped_mm`` and chapter 08's Triton kernel.
:class:`LocalDispatch` puts the three together: how an MoE reaches its experts when one process holds them all.
"""

from __future__ import annotations

import torch

from k3course import debug
from k3course.moe.balancing import quantile_balance_bias
from k3course.parts import is_replaced, part


def sort_by_expert(expert_idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert: order[r] = the slot at sorted row r; group_offsets[j] = end of expert j's rows.

    expert_idx [m, k] int -> (order [m k] int64, group_offsets [n_experts] int32, cumulative ends).
    The token of sorted row r is order[r] // k. group_offsets[j] = #{r : sorted id_r ≤ j}, a binary search
    in the sorted ids: no value is read back to the host (the range check runs under ``k3course.debug``).
    """
    if expert_idx.dim() != 2 or expert_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_idx must be an int tensor of shape [m, k], got {expert_idx.dtype} "
                         f"{tuple(expert_idx.shape)}")
    flat = expert_idx.reshape(-1)
    if debug.enabled() and flat.numel() and (flat.min() < 0 or flat.max() >= n_experts):
        raise ValueError(f"expert_idx entries must lie in [0, n_experts = {n_experts})")
    sorted_ids, order = torch.sort(flat, stable=True)  # [m k] each
    experts = torch.arange(n_experts, device=flat.device, dtype=flat.dtype)
    group_offsets = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)  # [n]
    return order, group_offsets


def unsort(rows_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Undo the sort: out[order[r]] = rows_sorted[r]. rows_sorted [m k, ...] -> [m k, ...] in slot order."""
    if rows_sorted.shape[0] != order.shape[0]:
        raise ValueError(f"rows_sorted has {rows_sorted.shape[0]} rows but order has {order.shape[0]} entries")
    # index_copy_ writes the rows where they belong; its backward is a gather, grad[order] (an unsort written
    # as a gather from the inverse permutation would need a scatter-add in backward, slower on a CPU)
    return rows_sorted.new_empty(rows_sorted.shape).index_copy_(0, order, rows_sorted)


def _grouped_mm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm has its fast path here: CUDA with compute capability >= 9.0, bf16 inputs, 16-byte rows.

    Other dtypes and devices take a per-group fallback inside torch (PyTorch PR #162059), no faster than ours.
    """
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    aligned = (x.shape[1] * x.element_size()) % 16 == 0 and (weight.shape[2] * weight.element_size()) % 16 == 0
    return x.dtype == weight.dtype == torch.bfloat16 and aligned


def expert_blocks(rows_sorted: torch.Tensor, group_offsets: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(expert, its rows) for every expert with rows: rows_sorted [M, ...] cut at group_offsets [E] (cumulative
    ends, read to the host once).

    The cut is one ``split``, not a slice per expert: in backward, autograd then joins the blocks' gradients
    with one concatenation, where E slices would each get a zero gradient of all M rows to be summed
    (E·M rows of memory traffic, E times what the split moves).
    """
    ends = group_offsets.tolist()
    sizes = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    return [(expert, rows) for expert, rows in enumerate(rows_sorted.split(sizes)) if rows.shape[0]]


@torch.library.custom_op("k3course::grouped_mm_loop", mutates_args=())
def _grouped_mm_loop(x_sorted: torch.Tensor, weight: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """The fallback: one GEMM per expert on its contiguous block of rows, concatenated in block order.

    An operator of its own (``torch.library``) with its backward below: ``torch.compile`` sees one opaque op of
    known output shape [M, d_out] where the loop's host read of the block sizes would break the graph.
    ``unbind`` hands out the experts' weights for the same reason as :func:`expert_blocks` splits the rows.
    """
    weights = weight.unbind(0)  # E views [d_in, d_out]
    blocks = [rows @ weights[expert] for expert, rows in expert_blocks(x_sorted, group_offsets)]
    return torch.cat(blocks) if blocks else x_sorted.new_zeros(0, weight.shape[2])


@_grouped_mm_loop.register_fake
def _(x_sorted, weight, group_offsets):
    return x_sorted.new_empty(x_sorted.shape[0], weight.shape[2])


@torch.library.custom_op("k3course::grouped_mm_weight_grad", mutates_args=())
def _grouped_weight_grad(x_sorted: torch.Tensor, grad_out: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """∂L/∂W_e = X_eᵀ G_e for every expert e (zero for an expert without rows). x_sorted [M, d_in], grad_out
    [M, d_out], group_offsets [E] -> [E, d_in, d_out]."""
    grad = x_sorted.new_zeros(group_offsets.shape[0], x_sorted.shape[1], grad_out.shape[1])
    grad_blocks = dict(expert_blocks(grad_out, group_offsets))
    for expert, rows in expert_blocks(x_sorted, group_offsets):
        torch.mm(rows.mT, grad_blocks[expert], out=grad[expert])
    return grad


@_grouped_weight_grad.register_fake
def _(x_sorted, grad_out, group_offsets):
    return x_sorted.new_empty(group_offsets.shape[0], x_sorted.shape[1], grad_out.shape[1])


def _loop_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _loop_backward(ctx, grad_out):
    """out_e = X_e W_e, so ∂L/∂X_e = G_e W_eᵀ (the same grouped product) and ∂L/∂W_e = X_eᵀ G_e."""
    x_sorted, weight, group_offsets = ctx.saved_tensors
    grad_x = _grouped_mm_loop(grad_out, weight.mT, group_offsets) if ctx.needs_input_grad[0] else None
    grad_w = _grouped_weight_grad(x_sorted, grad_out, group_offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_grouped_mm_loop.register_autograd(_loop_backward, setup_context=_loop_setup_context)


def grouped_mm_path(x_sorted: torch.Tensor, weight: torch.Tensor, kernels: str = "auto") -> str:
    """Which implementation :func:`grouped_mm` runs for the kernel backend ``kernels``
    (:data:`k3course.kernels.BACKENDS`): 'triton', 'torch' (``torch._grouped_mm``) or 'loop'.

    "loop" and "torch" are taken as asked; "triton" and "auto" are chapter 08's one-launch Triton kernel where
    :func:`k3course.kernels.use_triton` says so (always for "triton"; on CUDA for "auto") and the call is not
    being traced by ``torch.compile`` (the kernel's grid depends on the block sizes, which dynamo cannot hold as
    a constant: seen on an H200 with torch 2.11), else torch's grouped GEMM where it has its fast path (CUDA
    sm90+, bf16), else the loop (an operator of its own, so ``torch.compile`` traces it without a graph break).
    On CPU (torch 2.13) ``torch._grouped_mm`` runs in fp32 (not bf16), but no faster than the loop, its backward
    rejects a non-contiguous output gradient, and the compiler's shape rule for it accepts bf16 only: the loop
    is the CPU path.
    """
    from k3course.kernels import use_triton  # imported here: the dispatch does not depend on the kernels

    if kernels in ("loop", "torch"):
        return kernels
    if use_triton(x_sorted.device, kernels) and not torch.compiler.is_compiling():
        return "triton"
    return "torch" if _grouped_mm_available(x_sorted, weight) else "loop"


def grouped_mm(x_sorted: torch.Tensor, weight: torch.Tensor, group_offsets: torch.Tensor,
               impl: str = "auto") -> torch.Tensor:
    """out[r] = x_sorted[r] @ weight[e(r)], where e(r) is the expert whose block holds row r.

    x_sorted [M, d_in] (rows grouped by expert), weight [E, d_in, d_out], group_offsets [E] int32 cumulative
    block ends (the last equals M) -> [M, d_out].
    impl: a kernel backend (:data:`k3course.kernels.BACKENDS`): "loop" (one matmul per expert), "torch"
    (``torch._grouped_mm``), "triton" or "auto" (see :func:`grouped_mm_path`).
    """
    if x_sorted.dim() != 2 or weight.dim() != 3 or x_sorted.shape[1] != weight.shape[1]:
        raise ValueError(f"x_sorted [M, d_in] and weight [E, d_in, d_out] must agree on d_in, got "
                         f"{tuple(x_sorted.shape)} and {tuple(weight.shape)}")
    if group_offsets.shape != (weight.shape[0],):
        raise ValueError(f"group_offsets must have shape [E] = ({weight.shape[0]},), got {tuple(group_offsets.shape)}")
    if is_replaced("grouped_gemm"):  # a learner's kernel (chapter 08), while k3course.parts holds one
        return part("grouped_gemm", grouped_mm)(x_sorted, weight, group_offsets)
    chosen = grouped_mm_path(x_sorted, weight, impl)
    if chosen == "triton":
        from k3course.kernels.grouped_gemm import moe_grouped_gemm

        return moe_grouped_gemm(x_sorted, weight, group_offsets)
    if chosen == "torch":
        return torch._grouped_mm(x_sorted, weight, offs=group_offsets.to(torch.int32))
    return _grouped_mm_loop(x_sorted, weight, group_offsets)


class LocalDispatch:
    """How an :class:`~k3course.moe.MoE` reaches its routed experts when this process holds all of them (the
    default).

    Three methods, the contract every dispatcher keeps (:class:`k3course.distributed.AllToAllDispatch` keeps it
    with the experts spread over ranks):

        expert_outputs(experts, z, expert_idx)   E_{idx_ti}(z_t) for every token-slot: sort, bank, unsort
        pool_counts(tokens, load)                (M, load) of all tokens: here this process's own
        quantile_bias(scores, bias, k, tokens)   the quantile step on the scores of all M = tokens: here exact
    """

    def expert_outputs(self, experts: torch.nn.Module, z: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """E_{idx_ti}(z_t) for every token-slot, by sort-based dispatch through the bank ``experts``
        (:class:`~k3course.moe.experts.RoutedExperts`). z [m, w], expert_idx [m, k] -> [m, k, w]."""
        m, k = expert_idx.shape
        order, group_offsets = sort_by_expert(expert_idx, experts.gate_up.shape[0])  # [m k], [n]
        z_sorted = z.index_select(0, order // k)  # [m k, w]: row r is the token of slot order[r]
        out_sorted = experts(z_sorted, group_offsets)  # [m k, w]
        return unsort(out_sorted, order).view(m, k, z.shape[1])  # back in token order

    def pool_counts(self, tokens: int, load: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(M, load [n]) over all tokens: on one process the recorded ones, unchanged."""
        return tokens, load

    def quantile_bias(self, scores: torch.Tensor, bias: torch.Tensor, k: int, tokens: int) -> torch.Tensor:
        """:func:`~k3course.moe.quantile_balance_bias` on the scores [M, n] of all tokens (here M = ``tokens``
        are all on this process) -> new bias [n] (a learner's function while :mod:`k3course.parts` holds one)."""
        return part("quantile_balance_bias", quantile_balance_bias)(scores, bias, k)
