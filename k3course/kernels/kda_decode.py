"""KDA decoding: one fused recurrent step per token, the state updated in place (lesson 08).

At decode time T is 1 (or a few tokens of speculative decoding), so there is no chunk to parallelise over: one
program owns a [K, BV] slice of one head's state, keeps it in registers across the tokens, and writes it back
once. Per token t (all in fp32):

    S ← Diag(e^{g_t}) S                    decay first
    S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ         delta correction against the decayed state
    o_t = scale · Sᵀ q_t
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, scale, T, H, K, V,
                   BK: tl.constexpr, BV: tl.constexpr):
    """One program per (value block, batch·head): walk the T tokens with the state slice in registers."""
    v_block, bh = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # int64 offsets: (b·T + t)·H·K passes 2^31 at K3 size (T = 1M, H = 96, K = 128)
    b, h = bh // H, bh % H
    cols_k = tl.arange(0, BK)
    cols_v = v_block * BV + tl.arange(0, BV)
    mask_k, mask_v = cols_k < K, cols_v < V
    state_offsets = bh * K * V + cols_k[:, None] * V + cols_v[None, :]  # [BK, BV] inside [B, H, K, V]
    state_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptr + state_offsets, mask=state_mask, other=0.0)
    for t in range(T):
        k_offsets = ((b * T + t) * H + h) * K + cols_k
        v_offsets = ((b * T + t) * H + h) * V + cols_v
        q = tl.load(q_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_offsets, mask=mask_v, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + (b * T + t) * H + h).to(tl.float32)
        state = state * tl.exp(g)[:, None]
        prediction = tl.sum(k[:, None] * state, axis=0)  # [BV] = Sᵀ k
        state += k[:, None] * (beta * (v - prediction))[None, :]
        out = tl.sum((q * scale)[:, None] * state, axis=0)  # [BV] = scale Sᵀ q
        tl.store(o_ptr + v_offsets, out.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(state_ptr + state_offsets, state, mask=state_mask)


def kda_decode_triton(q, k, v, g, beta, state: torch.Tensor, scale: float | None = None):
    """Advance KDA by the T tokens given (T = 1 for plain decoding), updating ``state`` in place.

    S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ;  o_t = scale · S_tᵀ q_t.
    q, k, g: [B, T, H, K] (K ≤ 256); v: [B, T, H, V]; beta: [B, T, H]; state: [B, H, K, V] fp32, contiguous,
    on the inputs' device. Returns (o [B, T, H, V] in v's dtype, state) — the same state tensor, advanced.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    for name, x, shape in (("k", k, (B, T, H, K)), ("g", g, (B, T, H, K)), ("v", v, (B, T, H, V)),
                           ("beta", beta, (B, T, H)), ("state", state, (B, H, K, V))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise TypeError(f"state must be a contiguous fp32 tensor (updated in place), got {state.dtype}")
    if K > 256:
        raise ValueError(f"q: head dim K must be ≤ 256, got {K}")
    if TRITON_MODE == "interpreter" and q.dtype != torch.float32:
        raise TypeError(f"q: the Triton interpreter needs fp32 inputs, got {q.dtype}")
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    BV = min(32, max(16, triton.next_power_of_2(V)))
    _decode_kernel[(triton.cdiv(V, BV), B * H)](q, k, v, g, beta, state, o, scale, T, H, K, V,
                                                BK=max(16, triton.next_power_of_2(K)), BV=BV)
    return o, state
