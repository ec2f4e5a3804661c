"""Worked example for lesson 09: attention for ONE query per head, with the online softmax over key blocks.

The neighbour of exercise 09.flash_mla_forward (a block of queries per program, two score parts, the causal
diagonal, a cache prefix): here a program owns one query vector of one head, every key is visible (a decoding
step sees the whole cache), the score has one part, and there is no matrix product, only broadcasts and sums.
What carries over is the online softmax: a running max, a running sum and an accumulator, rescaled whenever the
max grows. Tested against torch (``tests/test_kernels_flash_mla.py``); fp32 under the interpreter.
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _one_query_kernel(q_ptr, k_ptr, v_ptr, o_ptr, scale, S, H, D, DV, BS: tl.constexpr, BD: tl.constexpr,
                      BDV: tl.constexpr):
    pair = tl.program_id(0)  # one (batch, head) pair: its single query against all S keys
    batch, head = pair // H, pair % H
    d, dv = tl.arange(0, BD), tl.arange(0, BDV)
    query = tl.load(q_ptr + pair * D + d, mask=d < D, other=0.0)                  # [BD]
    best = float("-inf")  # the largest score so far (a scalar: one query)
    norm = 0.0            # Σ e^{score − best} over the keys so far
    total = tl.zeros([BDV], dtype=tl.float32)  # Σ e^{score − best} v over the keys so far
    for s0 in range(0, S, BS):
        keys = s0 + tl.arange(0, BS)
        token = (batch * S + keys[:, None]) * H + head
        inside = keys < S
        k = tl.load(k_ptr + token * D + d[None, :], mask=inside[:, None] & (d[None, :] < D), other=0.0)
        score = tl.where(inside, tl.sum(k * query[None, :], axis=1) * scale, float("-inf"))  # [BS]
        grown = tl.maximum(best, tl.max(score, axis=0))
        weight = tl.exp(score - grown)
        shrink = tl.exp(best - grown)  # what the old sums were measured against, moved to the new max
        v = tl.load(v_ptr + token * DV + dv[None, :], mask=inside[:, None] & (dv[None, :] < DV), other=0.0)
        norm = norm * shrink + tl.sum(weight, axis=0)
        total = total * shrink + tl.sum(weight[:, None] * v, axis=0)
        best = grown
    tl.store(o_ptr + pair * DV + dv, total / norm, mask=dv < DV)


def attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     block: int = 16) -> torch.Tensor:
    """o[b, h] = Σ_s softmax_s(scale · q[b, h]·k[b, s, h]) v[b, s, h]: one query per head against every key.

    q [B, H, D], k [B, S, H, D], v [B, S, H, DV], fp32. One program per (batch, head), walking the keys in blocks
    of ``block``. Returns o [B, H, DV].
    """
    B, H, D = q.shape
    if k.dim() != 4 or tuple(k.shape[::2]) != (B, H) or k.shape[-1] != D:
        raise ValueError(f"k must be [B, S, H, D] with B = {B}, H = {H}, D = {D}, got {tuple(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v must be [B, S, H, DV] with [B, S, H] = {tuple(k.shape[:3])}, got {tuple(v.shape)}")
    S, DV = k.shape[1], v.shape[-1]
    q, k, v = (x.contiguous() for x in (q, k, v))
    o = torch.empty(B, H, DV, dtype=torch.float32, device=q.device)
    _one_query_kernel[(B * H,)](q, k, v, o, float(scale), S, H, D, DV, BS=block,
                                BD=triton.next_power_of_2(D), BDV=triton.next_power_of_2(DV))
    return o
