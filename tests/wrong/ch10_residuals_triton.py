"""Plausible wrong answers for chapter 10's Triton depth read: a softmax or key norm gone wrong in the kernel, and
torch code where a kernel is asked. One kernel with switches makes each mistake; one program per token."""

import k3course.kernels

k3course.kernels.select_triton_mode()  # first, before triton loads: the interpreter on a CPU (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _depth_read_kernel(w_ptr, g_ptr, v_ptr, h_ptr, a_ptr, N, T, D, tokens, stride_n, stride_b, stride_t, stride_d,
                       eps, BD: tl.constexpr, SUBTRACT_MAX: tl.constexpr, KEY_NORM: tl.constexpr,
                       KEY_WEIGHT: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.arange(0, BD)
    ok = cols < D
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    if KEY_WEIGHT:
        w = w * tl.load(g_ptr + cols, mask=ok, other=0.0)
    base = v_ptr + (token // T) * stride_b + (token % T) * stride_t + cols * stride_d
    top, total, acc = -float("inf"), 0.0, tl.zeros([BD], dtype=tl.float32)
    for i in range(N):
        v = tl.load(base + i * stride_n, mask=ok, other=0.0).to(tl.float32)
        s = tl.sum(v * w, axis=0)
        if KEY_NORM:
            s = s / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        tl.store(a_ptr + i * tokens + token, s)
        if SUBTRACT_MAX:
            new_top = tl.maximum(top, s)
            total = total * tl.exp(top - new_top) + tl.exp(s - new_top)
            acc = acc * tl.exp(top - new_top) + tl.exp(s - new_top) * v
            top = new_top
        else:
            total += tl.exp(s)
            acc += tl.exp(s) * v
    tl.store(h_ptr + token * D + cols, (acc / total).to(h_ptr.dtype.element_ty), mask=ok)
    for i in range(N):
        s = tl.load(a_ptr + i * tokens + token)
        weight = tl.exp(s - top) / total if SUBTRACT_MAX else tl.exp(s) / total
        tl.store(a_ptr + i * tokens + token, weight)


def _launch(query, key_weight, sources, eps, subtract_max=True, key_norm=True, key_weight_used=True):
    N, B, T, D = sources.shape
    h = torch.empty(B, T, D, dtype=sources.dtype)
    weights = torch.empty(N, B, T, dtype=torch.float32)
    if B * T:
        use_weight = key_weight is not None and key_weight_used
        _depth_read_kernel[(B * T,)](query, key_weight if use_weight else query, sources, h, weights, N, T, D, B * T,
                                     *sources.stride(), eps, BD=triton.next_power_of_2(D), SUBTRACT_MAX=subtract_max,
                                     KEY_NORM=key_norm, KEY_WEIGHT=use_weight)
    return h, weights


def depth_read_without_the_max(query, key_weight, sources, eps=1e-6):
    """Sums e^{s_i} as they come: overflows once the logits reach ~89."""
    return _launch(query, key_weight, sources, eps, subtract_max=False)


def depth_read_without_the_key_norm(query, key_weight, sources, eps=1e-6):
    """Raw sources as keys, s_i = (w ⊙ g)·v_i: a large source dominates."""
    return _launch(query, key_weight, sources, eps, key_norm=False)


def depth_read_ignoring_the_key_weight(query, key_weight, sources, eps=1e-6):
    """Drops K3's learned key-norm weight g."""
    return _launch(query, key_weight, sources, eps, key_weight_used=False)


def depth_read_in_torch(query, key_weight, sources, eps=1e-6):
    """The right values, in torch."""
    folded = query if key_weight is None else query * key_weight
    wide = sources.float()
    keys = torch.nn.functional.rms_norm(wide, (wide.shape[-1],), eps=eps)
    weights = torch.softmax(keys @ folded, dim=0)
    return torch.einsum("nbt,nbtd->btd", weights, wide).to(sources.dtype), weights


WRONG = {
    "10.depth_read_kernel": [depth_read_without_the_max, depth_read_without_the_key_norm,
                             depth_read_ignoring_the_key_weight, depth_read_in_torch],
}
