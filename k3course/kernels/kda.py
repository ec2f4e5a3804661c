"""The Triton KDA op the layers call: the fused decode step for one token at inference, else the chunk kernels."""

from __future__ import annotations

import torch

from k3course.kernels.kda_chunk import kda_chunk_triton
from k3course.kernels.kda_decode import kda_decode_triton


def kda_triton(q, k, v, g, beta, initial_state: torch.Tensor | None = None, chunk_size: int = 64):
    """KDA over the tokens given, continuing from ``initial_state``: returns (o [B, T, H, V], final_state fp32).

    S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ,  o_t = K^-1/2 · S_tᵀ q_t.
    One token with no gradient needed (decoding): :func:`kda_decode_triton` on a copy of the state (the caller's
    tensor is left as it was). Otherwise: :func:`kda_chunk_triton` (prefill and training; differentiable).
    Shapes as in ``kda_chunk_triton``; chunk_size ∈ {16, 32, 64}.
    """
    decoding = q.shape[1] == 1 and not (torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)))
    if decoding:
        B, _, H, K = q.shape
        state = (initial_state.to(torch.float32).clone().contiguous() if initial_state is not None
                 else torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=q.device))
        return kda_decode_triton(q, k, v, g, beta, state)
    return kda_chunk_triton(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                            chunk_size=chunk_size)
