"""Block AttnRes's depth read in one pass over the sources, forward and backward (lesson 10).

Every read of an attention residual stream mixes its N sources v_i (the embedding, the block sums, the partial
sum: ``[N, B, T, D]``) per token with a softmax over depth (K3's learned key-norm weight g is already folded into
the query, w·(g ⊙ RMSNorm(v)) = (w ⊙ g)·RMSNorm(v)):

    r_i = (mean_d v_i² + ε)^{-1/2},   s_i = r_i (w · v_i),   α = softmax_i(s),   h = Σ_i α_i v_i.

One program owns BT tokens and the whole width D (a [BT, BD] tile) and walks the N sources once, with the online
softmax of lesson 08: the running maximum m, the running denominator ℓ and the unnormalised sum, rescaled by
e^{m_old − m_new} whenever the maximum grows. The logits go out as they are found and become the weights
α_i = e^{s_i − m} / ℓ in a last sweep over N numbers per token, so the sources ([N, B, T, D]) are read once and
the keys RMSNorm(v_i) never exist.

The backward, with upstream ∂L/∂h, is two sweeps (the first only for the softmax's mean):
    ∂L/∂α_i = v_i · ∂L/∂h,   ∂L/∂s_i = α_i (∂L/∂α_i − Σ_j α_j ∂L/∂α_j),   c_i = r_i ∂L/∂s_i,
    ∂L/∂v_i = α_i ∂L/∂h + c_i (w − s_i r_i v_i / D),   ∂L/∂w = Σ_tokens Σ_i c_i v_i,
with r_i and s_i recomputed from v_i (cheaper than storing them); each program writes its tokens' share of ∂L/∂w
and torch sums the shares (a fixed order: the same bits every run, unlike atomics).
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3course.ops.norm import NORM_EPS  # noqa: E402

MAX_WIDTH = 16384  # the widest D one program holds in registers (K3: 7168)
SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _first_source(v_ptr, rows, cols, T, stride_vb, stride_vt, stride_vd):
    """Pointers [BT, BD] to source 0's entries of tokens ``rows`` (b·T + t); source i is ``+ i·stride_vn`` on."""
    token_offsets = (rows // T).to(tl.int64) * stride_vb + (rows % T).to(tl.int64) * stride_vt
    return v_ptr + token_offsets[:, None] + cols[None, :].to(tl.int64) * stride_vd


@triton.jit
def _depth_forward_kernel(v_ptr, w_ptr, h_ptr, weights_ptr, N, T, D, tokens, stride_vn, stride_vb, stride_vt,
                          stride_vd, stride_w, eps, BT: tl.constexpr, BD: tl.constexpr):
    """h [tokens, D] and the weights α [N, tokens] of BT tokens, one online-softmax sweep over the N sources."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)  # token = b·T + t
    cols = tl.arange(0, BD)
    row_ok, col_ok = rows < tokens, cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    source = _first_source(v_ptr, rows, cols, T, stride_vb, stride_vt, stride_vd)
    w = tl.load(w_ptr + cols * stride_w, mask=col_ok, other=0.0).to(tl.float32)
    running_max = tl.full([BT], float("-inf"), dtype=tl.float32)
    denominator = tl.zeros([BT], dtype=tl.float32)
    acc = tl.zeros([BT, BD], dtype=tl.float32)  # Σ_i e^{s_i − m} v_i
    for i in range(N):
        v = tl.load(source, mask=mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)  # r_i, [BT]
        logit = tl.sum(v * w[None, :], axis=1) * inv_rms  # s_i, [BT]
        tl.store(weights_ptr + i * tokens + rows, logit, mask=row_ok)
        source += stride_vn
        new_max = tl.maximum(running_max, logit)
        rescale, p = tl.exp(running_max - new_max), tl.exp(logit - new_max)
        acc = acc * rescale[:, None] + p[:, None] * v
        denominator = denominator * rescale + p
        running_max = new_max
    h = acc / denominator[:, None]
    tl.store(h_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
    for i in range(N):  # logits -> weights: N numbers per token, the sources are not read again
        logit = tl.load(weights_ptr + i * tokens + rows, mask=row_ok, other=0.0)
        tl.store(weights_ptr + i * tokens + rows, tl.exp(logit - running_max) / denominator, mask=row_ok)


@triton.jit
def _depth_backward_kernel(v_ptr, w_ptr, weights_ptr, dh_ptr, dv_ptr, dw_part_ptr, N, T, D, tokens, stride_vn,
                           stride_vb, stride_vt, stride_vd, stride_w, stride_dvn, eps, BT: tl.constexpr,
                           BD: tl.constexpr):
    """∂L/∂v [N, tokens, D] and this program's share of ∂L/∂w [D] for BT tokens (see the module docstring)."""
    program = tl.program_id(0)
    rows = program * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    row_ok, col_ok = rows < tokens, cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    source = _first_source(v_ptr, rows, cols, T, stride_vb, stride_vt, stride_vd)
    flat = rows[:, None].to(tl.int64) * D + cols[None, :]  # [BT, BD] inside a contiguous [tokens, D]
    w = tl.load(w_ptr + cols * stride_w, mask=col_ok, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + flat, mask=mask, other=0.0).to(tl.float32)
    mean_grad = tl.zeros([BT], dtype=tl.float32)  # Σ_j α_j ∂L/∂α_j
    walker = source
    for i in range(N):
        v = tl.load(walker, mask=mask, other=0.0).to(tl.float32)
        alpha = tl.load(weights_ptr + i * tokens + rows, mask=row_ok, other=0.0)
        mean_grad += alpha * tl.sum(v * dh, axis=1)
        walker += stride_vn
    dw = tl.zeros([BD], dtype=tl.float32)
    grad_source = dv_ptr + flat  # source i's gradient: stride_dvn = tokens·D further on per i
    for i in range(N):
        v = tl.load(source, mask=mask, other=0.0).to(tl.float32)
        alpha = tl.load(weights_ptr + i * tokens + rows, mask=row_ok, other=0.0)
        inv_rms = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        logit = tl.sum(v * w[None, :], axis=1) * inv_rms
        c = inv_rms * alpha * (tl.sum(v * dh, axis=1) - mean_grad)  # r_i ∂L/∂s_i, [BT]
        dv = alpha[:, None] * dh + c[:, None] * (w[None, :] - (logit * inv_rms / D)[:, None] * v)
        tl.store(grad_source, dv.to(dv_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(c[:, None] * v, axis=0)
        source += stride_vn
        grad_source += stride_dvn
    tl.store(dw_part_ptr + program.to(tl.int64) * D + cols, dw, mask=col_ok)


def _tiles(D: int) -> tuple[int, int, int]:
    """(BT tokens, BD ≥ D columns, warps) of one program: about 2048 numbers per tile, at least one token."""
    width = triton.next_power_of_2(D)
    return max(1, min(16, 2048 // width)), width, 8 if width >= 2048 else 4


def _check_inputs(query: torch.Tensor, sources: torch.Tensor, eps: float) -> None:
    if not isinstance(sources, torch.Tensor) or sources.dim() != 4 or sources.shape[0] < 1:
        shape = tuple(sources.shape) if isinstance(sources, torch.Tensor) else type(sources).__name__
        raise ValueError(f"sources must be [N ≥ 1, B, T, D], got {shape}")
    D = sources.shape[-1]
    if not isinstance(query, torch.Tensor) or query.dim() != 1 or query.shape[0] != D:
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be [D={D}] (the sources' width), got {shape}")
    if sources.dtype not in SOURCE_DTYPES or query.dtype not in SOURCE_DTYPES:
        raise TypeError(f"query and sources must be one of {SOURCE_DTYPES}, got {query.dtype} and {sources.dtype}")
    if query.device != sources.device:
        raise ValueError(f"query and sources must be on one device, got {query.device} and {sources.device}")
    if D > MAX_WIDTH:
        raise ValueError(f"sources' width D must be ≤ {MAX_WIDTH} (one program holds a whole row), got {D}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")


def depth_attention_forward(query: torch.Tensor, sources: torch.Tensor,
                            eps: float = NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """h = Σ_i softmax_i(r_i query·v_i) v_i, r_i = (mean_d v_i² + ε)^{-1/2}, in one sweep over the sources.

    query [D]; sources [N, B, T, D] (any strides), fp32 / bf16 / fp16 -> (h [B, T, D] in the sources' dtype,
    weights α [N, B, T] fp32). Computed in fp32. Forward only: :func:`depth_attention_triton` differentiates it.
    """
    _check_inputs(query, sources, eps)
    N, B, T, D = sources.shape
    tokens = B * T
    h = torch.empty(B, T, D, dtype=sources.dtype, device=sources.device)
    weights = torch.empty(N, B, T, dtype=torch.float32, device=sources.device)
    if tokens == 0:
        return h, weights
    block_tokens, width, warps = _tiles(D)
    _depth_forward_kernel[(triton.cdiv(tokens, block_tokens),)](
        sources, query, h, weights, N, T, D, tokens, *sources.stride(), query.stride(0), eps, BT=block_tokens,
        BD=width, num_warps=warps)
    return h, weights


def depth_attention_backward(query: torch.Tensor, sources: torch.Tensor, weights: torch.Tensor,
                             grad_h: torch.Tensor, eps: float = NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂L/∂query [D] in the query's dtype, ∂L/∂sources [N, B, T, D] in the sources' dtype, contiguous) from the
    forward's weights [N, B, T] fp32 and ∂L/∂h [B, T, D]; two sweeps over the sources (module docstring)."""
    _check_inputs(query, sources, eps)
    N, B, T, D = sources.shape
    if tuple(grad_h.shape) != (B, T, D):
        raise ValueError(f"grad_h must be [B, T, D] = {(B, T, D)}, got {tuple(grad_h.shape)}")
    tokens = B * T
    grad_sources = torch.empty(N, B, T, D, dtype=sources.dtype, device=sources.device)
    if tokens == 0:
        return torch.zeros_like(query), grad_sources
    block_tokens, width, warps = _tiles(D)
    programs = triton.cdiv(tokens, block_tokens)
    grad_query_parts = torch.empty(programs, D, dtype=torch.float32, device=sources.device)
    _depth_backward_kernel[(programs,)](
        sources, query, weights.contiguous(), grad_h.contiguous(), grad_sources, grad_query_parts, N, T, D, tokens,
        *sources.stride(), query.stride(0), grad_sources.stride(0), eps, BT=block_tokens, BD=width, num_warps=warps)
    return grad_query_parts.sum(0).to(query.dtype), grad_sources


class _DepthAttentionTriton(torch.autograd.Function):
    """The depth read's kernels as an op autograd differentiates once (the weights are not differentiable)."""

    @staticmethod
    def forward(ctx, query, sources, eps):
        h, weights = depth_attention_forward(query, sources, eps)
        ctx.save_for_backward(query, sources, weights)
        ctx.eps = eps
        ctx.mark_non_differentiable(weights)
        return h, weights

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_h, _):
        query, sources, weights = ctx.saved_tensors
        grad_query, grad_sources = depth_attention_backward(query, sources, weights, grad_h, ctx.eps)
        return grad_query, grad_sources, None


def depth_attention_triton(query: torch.Tensor, sources: torch.Tensor,
                           eps: float = NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`k3course.layers.residual.depth_attention` on the Triton kernels, forward and backward.

    query [D]; sources [N, B, T, D] -> (h [B, T, D] in the sources' dtype, weights [N, B, T] fp32).
    """
    return _DepthAttentionTriton.apply(query, sources, eps)
