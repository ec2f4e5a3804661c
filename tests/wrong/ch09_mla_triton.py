"""Plausible wrong answers for chapter 09's Triton rung: a FlashAttention-style forward with one mistake each.

One kernel, each mistake a constexpr switch, so that each wrong answer differs from a right one in exactly the
line its name says; 16 × 16 tiles, fp32, under the interpreter on a CPU.
"""

import k3course.kernels

k3course.kernels.select_triton_mode()  # first, before triton loads: the interpreter on a CPU (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _load_rows(ptr, stride_b, stride_t, stride_h, b, h, rows, n_rows, cols, width):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < width)
    return tl.load(ptr + b * stride_b + rows[:, None] * stride_t + h * stride_h + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _attention_kernel(qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, o_ptr, lse_ptr, scale, T, S, H, N, E, V, start,
                      sqn_b, sqn_t, sqn_h, sqr_b, sqr_t, sqr_h, skn_b, skn_t, skn_h, skr_b, skr_t, sv_b, sv_t, sv_h,
                      BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
                      RESCALE: tl.constexpr, SCALE_TWICE: tl.constexpr, SHIFT_BY_START: tl.constexpr):
    m_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    q_rows, cols = m_block * BM + tl.arange(0, BM), tl.arange(0, BD)
    q_nope = _load_rows(qn_ptr, sqn_b, sqn_t, sqn_h, b, h, q_rows, T, cols, N)
    q_rope = _load_rows(qr_ptr, sqr_b, sqr_t, sqr_h, b, h, q_rows, T, cols, E)
    if SCALE_TWICE:  # the scale folded into the queries, and applied to the scores as well
        q_nope, q_rope = q_nope * scale, q_rope * scale
    shift = start if SHIFT_BY_START else 0
    running_max = tl.full([BM], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for n0 in range(0, tl.minimum(S, shift + (m_block + 1) * BM), BN):
        k_rows = n0 + tl.arange(0, BN)
        k_nope = _load_rows(kn_ptr, skn_b, skn_t, skn_h, b, h, k_rows, S, cols, N)
        k_rope = _load_rows(kr_ptr, skr_b, skr_t, 0, b, h, k_rows, S, cols, E)
        x = (tl.dot(q_nope, tl.trans(k_nope), input_precision="ieee")
             + tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")) * scale
        visible = k_rows[None, :] < S
        if MASK_DIAGONAL:
            visible = visible & (k_rows[None, :] <= shift + q_rows[:, None])
        x = tl.where(visible, x, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=1))
        p = tl.exp(x - new_max[:, None])
        values = _load_rows(v_ptr, sv_b, sv_t, sv_h, b, h, k_rows, S, cols, V)
        if RESCALE:
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(p, axis=1)
            acc = acc * tl.exp(running_max - new_max)[:, None] + tl.dot(p, values, input_precision="ieee")
        else:  # the sum rescaled, the accumulator not
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(p, axis=1)
            acc = acc + tl.dot(p, values, input_precision="ieee")
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(o_ptr + b * T * H * V + q_rows[:, None] * H * V + h * V + cols[None, :], out,
             mask=(q_rows[:, None] < T) & (cols[None, :] < V))
    tl.store(lse_ptr + bh * T + q_rows, running_max + tl.log(running_sum), mask=q_rows < T)


def _attention(q_nope, q_rope, k_nope, k_rope, values, scale, start=0, **mistakes):
    """The launcher with every mistake off unless named: (o [B, T, H, v], L [B, H, T])."""
    B, T, H, N = q_nope.shape
    S, E, V = k_nope.shape[1], q_rope.shape[-1], values.shape[-1]
    out = torch.empty(B, T, H, V)
    lse = torch.empty(B, H, T)
    switches = dict(MASK_DIAGONAL=True, RESCALE=True, SCALE_TWICE=False, SHIFT_BY_START=True)
    switches.update(mistakes)
    _attention_kernel[(triton.cdiv(T, 16), B * H)](
        q_nope, q_rope, k_nope, k_rope, values, out, lse, scale, T, S, H, N, E, V, start,
        *q_nope.stride()[:3], *q_rope.stride()[:3], *k_nope.stride()[:3], *k_rope.stride()[:2], *values.stride()[:3],
        BM=16, BN=16, BD=triton.next_power_of_2(max(16, N, E, V)), **switches)
    return out, lse


def flash_without_the_diagonal_mask(q_nope, q_rope, k_nope, k_rope, values, scale, start=0):
    """Stops the key loop at the causal limit but masks no key inside the diagonal block: queries see up to 15
    future keys."""
    return _attention(q_nope, q_rope, k_nope, k_rope, values, scale, start, MASK_DIAGONAL=False)


def flash_without_rescaling_the_accumulator(q_nope, q_rope, k_nope, k_rope, values, scale, start=0):
    """Rescales the running sum by e^{m − m'} when the max grows, but not the accumulator."""
    return _attention(q_nope, q_rope, k_nope, k_rope, values, scale, start, RESCALE=False)


def flash_with_the_scale_twice(q_nope, q_rope, k_nope, k_rope, values, scale, start=0):
    """Scales the queries and the scores: x = scale² q·k."""
    return _attention(q_nope, q_rope, k_nope, k_rope, values, scale, start, SCALE_TWICE=True)


def flash_ignoring_the_cache_prefix(q_nope, q_rope, k_nope, k_rope, values, scale, start=0):
    """Query t sees keys s ≤ t instead of s ≤ start + t (right without a cache prefix)."""
    return _attention(q_nope, q_rope, k_nope, k_rope, values, scale, start, SHIFT_BY_START=False)


def flash_in_torch(q_nope, q_rope, k_nope, k_rope, values, scale, start=0):
    """The right values, in torch."""
    T, S = q_nope.shape[1], k_nope.shape[1]
    scores = scale * (torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthe,bse->bhts", q_rope, k_rope))
    scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(start + 1), float("-inf"))
    out = torch.einsum("bhts,bshv->bthv", scores.softmax(-1), values)
    return out, scores.logsumexp(-1)


WRONG = {
    "09.flash_mla_forward": [flash_without_the_diagonal_mask, flash_without_rescaling_the_accumulator,
                             flash_with_the_scale_twice, flash_ignoring_the_cache_prefix, flash_in_torch],
}
