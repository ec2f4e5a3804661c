"""The Triton KDA op the layers call: the chunk kernels or the fused recurrent kernel, as the layer's path rule says."""

from __future__ import annotations

import torch

from k3course.kernels.kda_chunk import kda_chunk_triton
from k3course.kernels.kda_decode import kda_decode_triton
from k3course.ops.recurrent import kda_recurrent


def kda_triton(q, k, v, g, beta, initial_state: torch.Tensor | None = None, *, chunked: bool, chunk_size: int = 64,
               lower_bound: float | None = None):
    """KDA over the tokens given, continuing from ``initial_state``: returns (o [B, T, H, V], final_state fp32).

    S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ,  o_t = K^-1/2 · S_tᵀ q_t.
    ``chunked`` is the layer's path (its ``mode`` and ``uses_chunked_op``), honoured as on the torch path:
    chunked: :func:`kda_chunk_triton` with ``chunk_size`` ∈ {16, 32, 64} and ``lower_bound`` (differentiable);
    recurrent: :func:`kda_decode_triton`, the fused recurrent kernel, on a copy of the state (the caller's tensor
    is left as it was) — or, when a gradient is needed, the torch recurrent op (the fused kernel has no backward).
    Shapes as in ``kda_chunk_triton``.
    """
    if chunked:
        return kda_chunk_triton(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                chunk_size=chunk_size, lower_bound=lower_bound)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)):
        return kda_recurrent(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
    B, _, H, K = q.shape
    state = (initial_state.to(torch.float32).clone().contiguous() if initial_state is not None
             else torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=q.device))
    return kda_decode_triton(q, k, v, g, beta, state)
