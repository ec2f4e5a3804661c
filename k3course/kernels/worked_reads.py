"""Worked examples for lessons 03 and 10: Triton kernels for problems *next to* the exercises', never their own.

- :func:`prenorm_read`  the standard residual's read h = Σ_i v_i, one sweep over strided sources
                        (exercise: Block AttnRes's depth read, a softmax over the same sources)
- :func:`expert_load`   token-slots per expert from the router's choices, counted with atomic adds
                        (exercise: the margin histogram, counts per expert *and* bin)

Each is tested against torch (``tests/test_kernels_worked_reads.py``); fp32 under the interpreter.
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _prenorm_read_kernel(v_ptr, h_ptr, N, T, D, tokens, stride_n, stride_b, stride_t, stride_d,
                         BT: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)  # this program's tokens, b·T + t
    cols = tl.arange(0, BD)  # the whole width
    inside = (rows < tokens)[:, None] & (cols < D)[None, :]
    where = v_ptr + (rows // T)[:, None] * stride_b + (rows % T)[:, None] * stride_t + cols[None, :] * stride_d
    total = tl.zeros([BT, BD], dtype=tl.float32)
    for _ in range(N):  # one source per step: a [BT, BD] tile, read once
        total += tl.load(where, mask=inside, other=0.0).to(tl.float32)
        where += stride_n
    tl.store(h_ptr + rows[:, None] * D + cols[None, :], total.to(h_ptr.dtype.element_ty), mask=inside)


def prenorm_read(sources: torch.Tensor, block_tokens: int = 4) -> torch.Tensor:
    """h = Σ_i v_i per token (PreNorm's stream, read from its N terms). sources [N, B, T, D], any strides ->
    h [B, T, D] in the sources' dtype, summed in fp32; one program per ``block_tokens`` tokens and the whole width."""
    if sources.dim() != 4:
        raise ValueError(f"sources must be [N, B, T, D], got shape {tuple(sources.shape)}")
    N, B, T, D = sources.shape
    h = torch.empty(B, T, D, dtype=sources.dtype, device=sources.device)
    if B * T:
        _prenorm_read_kernel[(triton.cdiv(B * T, block_tokens),)](
            sources, h, N, T, D, B * T, *sources.stride(), BT=block_tokens, BD=triton.next_power_of_2(D))
    return h


@triton.jit
def _expert_load_kernel(idx_ptr, load_ptr, slots, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = index < slots
    expert = tl.load(idx_ptr + index, mask=inside, other=0)
    tl.atomic_add(load_ptr + expert, 1, mask=inside)  # two slots of one expert, in any program, both count


def expert_load(expert_idx: torch.Tensor, n: int, block: int = 64) -> torch.Tensor:
    """load_j = #{(t, slot) : expert_idx[t, slot] = j}. expert_idx [m, k] int32/int64 -> load [n] int64."""
    if expert_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_idx must be an integer tensor, got dtype {expert_idx.dtype}")
    flat = expert_idx.reshape(-1).contiguous()
    load = torch.zeros(n, dtype=torch.int32, device=flat.device)
    if flat.numel():
        _expert_load_kernel[(triton.cdiv(flat.numel(), block),)](flat, load, flat.numel(), BLOCK=block)
    return load.long()
