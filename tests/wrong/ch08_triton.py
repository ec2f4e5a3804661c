"""Plausible wrong answers for chapter 08: Triton kernels with a Triton bug, and torch code where a kernel is asked.

The torch answers compute the right thing the wrong way (the check refuses torch math in a Triton exercise);
the kernels run under the interpreter on CPU, small shapes.
"""

import k3course.kernels

k3course.kernels.select_triton_mode()  # first, before triton loads: the interpreter on a CPU (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3course.kernels.kda_chunk import intra_chunk_factors, kda_chunk_from_kernels, output_from_states, state_pass  # noqa: E402


@triton.jit
def _scale_add_alpha_on_y_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x, y = tl.load(x_ptr + offsets, mask=mask, other=0.0), tl.load(y_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, x + alpha * y, mask=mask)


def scale_add_alpha_on_y(x, y, alpha, block=64):
    """Scales the wrong vector: x + alpha · y."""
    out = torch.empty_like(x)
    _scale_add_alpha_on_y_kernel[(triton.cdiv(x.numel(), block),)](x, y, out, alpha, x.numel(), BLOCK=block)
    return out


def scale_add_one_program(x, y, alpha, block=64):
    """Launches one program whatever n: only the first block is computed."""
    out = torch.zeros_like(x)
    _scale_add_alpha_on_y_kernel[(1,)](y, x, out, alpha, x.numel(), BLOCK=block)  # (y, x) swapped back: α·x + y
    return out


def scale_add_in_torch(x, y, alpha, block=64):
    """The right values, in torch."""
    return alpha * x + y


@triton.jit
def _matmul_one_k_tile_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    depth = tl.arange(0, BK)
    a = tl.load(a_ptr + rows[:, None] * K + depth[None, :], mask=(rows[:, None] < M) & (depth[None, :] < K), other=0.0)
    b = tl.load(b_ptr + depth[:, None] * N + cols[None, :], mask=(depth[:, None] < K) & (cols[None, :] < N), other=0.0)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], tl.dot(a, b, input_precision="ieee"),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul_without_the_k_loop(a, b, block=16):
    """One tile of depth per output tile: right only when K ≤ block."""
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32)
    _matmul_one_k_tile_kernel[(triton.cdiv(M, block), triton.cdiv(N, block))](a.contiguous(), b.contiguous(), c,
                                                                            M, N, K, BM=block, BN=block, BK=block)
    return c


def matmul_in_torch(a, b, block=16):
    """The right product, in torch."""
    return a @ b


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, scale, T, H, K, V, BK: tl.constexpr,
                   BV: tl.constexpr):
    """KDA's recurrence for the T tokens of one call, the state [K, V] of one (batch, head) in registers."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    rows, cols = tl.arange(0, BK), tl.arange(0, BV)
    mask_k, mask_v = rows < K, cols < V
    offsets = bh * K * V + rows[:, None] * V + cols[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptr + offsets, mask=mask, other=0.0)
    for t in range(T):
        token = (b * T + t) * H + h
        q = tl.load(q_ptr + token * K + rows, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + token * K + rows, mask=mask_k, other=0.0)
        g = tl.load(g_ptr + token * K + rows, mask=mask_k, other=0.0)
        v = tl.load(v_ptr + token * V + cols, mask=mask_v, other=0.0)
        state = state * tl.exp(g)[:, None]
        state += k[:, None] * (tl.load(beta_ptr + token) * (v - tl.sum(k[:, None] * state, axis=0)))[None, :]
        tl.store(o_ptr + token * V + cols, tl.sum((q * scale)[:, None] * state, axis=0), mask=mask_v)
    tl.store(state_ptr + offsets, state, mask=mask)


def decode_returns_a_new_state(q, k, v, g, beta, state, scale=None):
    """The right kernel, launched on a copy of the state: right outputs, but the caller's state never moves
    (decoding then forgets every token)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    new_state, o = state.clone(), torch.empty_like(v)
    _decode_kernel[(B * H,)](q, k, v, g, beta, new_state, o, K ** -0.5 if scale is None else scale, T, H, K, V,
                             BK=max(16, triton.next_power_of_2(K)), BV=max(16, triton.next_power_of_2(V)))
    return o, new_state


def decode_in_torch(q, k, v, g, beta, state, scale=None):
    """The recurrence in torch (the package's), copied into the state: right values, no kernel."""
    from k3course.ops.recurrent import kda_recurrent

    o, final = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True)
    state.copy_(final)
    return o, state


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr, SUBTRACT_MAX: tl.constexpr, PAD: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=PAD)
    e = tl.exp(x - tl.max(x, axis=0)) if SUBTRACT_MAX else tl.exp(x)
    tl.store(y_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


def _softmax(x, subtract_max, pad):
    y = torch.empty_like(x)
    _softmax_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]),
                                   SUBTRACT_MAX=subtract_max, PAD=pad)
    return y


def softmax_without_the_max(x):
    """e^x / Σ e^x: inf / inf = NaN once a logit passes 88."""
    return _softmax(x, subtract_max=False, pad=-float("inf"))


def softmax_padded_with_zeros(x):
    """Pads with 0 instead of −inf: e^{0 − m} of every padded column joins the sum."""
    return _softmax(x, subtract_max=True, pad=0.0)


@triton.jit
def _online_softmax_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr, RESCALE: tl.constexpr,
                           MAX_FROM_ZERO: tl.constexpr):
    """The online softmax with one of two slips: no rescaling of s when the max grows (RESCALE=False), or a
    running max that starts at 0 instead of −inf (MAX_FROM_ZERO=True)."""
    row = tl.program_id(0)
    if MAX_FROM_ZERO:
        m = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    else:
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        if RESCALE:
            s = s * tl.exp(m - m_new)
        s = s + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=-float("inf"))
        tl.store(y_ptr + row * n_cols + cols, tl.exp(x - m) / s, mask=cols < n_cols)


def softmax_online_without_rescaling(x, block=64):
    """Forgets s ← s e^{m − m'} when the maximum grows: right only if the first block holds the row max."""
    y = torch.empty_like(x)
    _online_softmax_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=block, RESCALE=False, MAX_FROM_ZERO=False)
    return y


def l2norm_in_torch(x):
    """The right values, written in torch instead of a kernel."""
    return x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()


@triton.jit
def _l2norm_eps_outside_kernel(x_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * n_cols + cols, x / (tl.sqrt(tl.sum(x * x, axis=0)) + eps), mask=mask)


def l2norm_eps_outside_sqrt(x):
    """x / (‖x‖ + eps): the same as the reference unless a row's norm is tiny."""
    y = torch.empty_like(x)
    _l2norm_eps_outside_kernel[(x.shape[0],)](x, y, x.shape[1], 1e-6, BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


@triton.jit
def _cumsum_never_resets_kernel(g_ptr, out_ptr, T, H, K, BT: tl.constexpr, BK: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    rows, cols = tl.arange(0, BT), tl.arange(0, BK)
    offsets = ((b * T + rows[:, None]) * H + h) * K + cols[None, :]
    mask = (rows[:, None] < T) & (cols[None, :] < K)
    tl.store(out_ptr + offsets, tl.cumsum(tl.load(g_ptr + offsets, mask=mask, other=0.0), axis=0), mask=mask)


def cumsum_one_chunk_for_all(g, chunk_size=64):
    """One program per (batch, head) over the whole sequence: the sum never restarts at a chunk boundary."""
    B, T, H, K = g.shape
    out = torch.empty(B, T, H, K, dtype=torch.float32)
    _cumsum_never_resets_kernel[(B * H,)](g.contiguous(), out, T, H, K, BT=triton.next_power_of_2(T),
                                          BK=triton.next_power_of_2(K))
    return out


@triton.jit
def _tile_kernel(k_ptr, gc_ptr, out_ptr, row_start, col_start, K, BC: tl.constexpr, BK: tl.constexpr,
                 FACTORED: tl.constexpr):
    local, cols = tl.arange(0, BC), tl.arange(0, BK)
    mask = cols[None, :] < K
    offs_r = (row_start + local)[:, None] * K + cols[None, :]
    offs_c = (col_start + local)[:, None] * K + cols[None, :]
    k_r, g_r = tl.load(k_ptr + offs_r, mask=mask, other=0.0), tl.load(gc_ptr + offs_r, mask=mask, other=0.0)
    k_c, g_c = tl.load(k_ptr + offs_c, mask=mask, other=0.0), tl.load(gc_ptr + offs_c, mask=mask, other=0.0)
    if FACTORED:  # e^{G_r} · e^{−G_i}: e^{−G_i} overflows fp32 at strong decay
        rows_scaled, cols_scaled = k_r * tl.exp(g_r), k_c * tl.exp(-g_c)
    else:
        g_ref = tl.load(gc_ptr + row_start * K + cols, mask=cols < K, other=0.0)
        rows_scaled, cols_scaled = k_r * tl.exp(g_r - g_ref[None, :]), k_c * tl.exp(g_ref[None, :] - g_c)
    tile = tl.dot(rows_scaled, tl.trans(cols_scaled), input_precision="ieee")
    tl.store(out_ptr + local[:, None] * BC + local[None, :], tile)


def _launch_tile(k, gc, row_start, col_start, size, block, factored):
    out = torch.zeros(size, size, dtype=torch.float32)
    _tile_kernel[(1,)](k.contiguous(), gc.contiguous(), out, row_start, col_start, k.shape[1], BC=block,
                       BK=max(16, triton.next_power_of_2(k.shape[1])), FACTORED=factored)
    return out


def tile_factored_naively(k, gc, row_start, col_start, size=16):
    """(K_r ⊙ e^{G_r})(K_i ⊙ e^{−G_i})ᵀ in the kernel: NaN once −G passes 88."""
    return _launch_tile(k, gc, row_start, col_start, size, size, factored=True)


def tile_always_16_wide(k, gc, row_start, col_start, size=16):
    """Hard-codes BC = 16: a wider tile is only partly written (the kernel stores at stride 16, too)."""
    return _launch_tile(k, gc, row_start, col_start, size, 16, factored=False)


def tile_in_torch(k, gc, row_start, col_start, size=16):
    """The right tile, in torch."""
    rows, cols = slice(row_start, row_start + size), slice(col_start, col_start + size)
    ref = gc[row_start]
    return (k[rows] * torch.exp(gc[rows] - ref)) @ (k[cols] * torch.exp(ref - gc[cols])).T


@triton.jit
def _store_far_out_of_range_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=0.0)
    tl.store(y_ptr + (row * n_cols + cols) * 100_000_000, x)  # no mask, and a stride that leaves the tensor


def l2norm_unmasked_store_crashes(x):
    """An unmasked store far outside the output: kills the process that runs it (SIGSEGV under the interpreter)."""
    y = torch.empty_like(x)
    _store_far_out_of_range_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


@triton.jit
def _l2norm_unmasked_store_kernel(x_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=0.0)
    tl.store(y_ptr + row * n_cols + cols, x / tl.sqrt(tl.sum(x * x, axis=0) + eps))  # no mask on the store


def l2norm_store_runs_past_the_end(x):
    """Masks the load but not the store: the last row writes BLOCK − D zeros past the output. Every value it
    returns is right; the heap behind the output is corrupted, which aborts the process when it is freed."""
    y = torch.empty_like(x)
    _l2norm_unmasked_store_kernel[(x.shape[0],)](x, y, x.shape[1], 1e-6, BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


@triton.jit
def _softmax_zero_padded_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)  # the padding (0) joins the max
    e = tl.where(mask, tl.exp(x - tl.max(x, axis=0)), 0.0)
    tl.store(y_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=mask)


def softmax_max_includes_the_padding(x):
    """Pads with 0 and keeps the padding out of the sum, but not out of the max: when every entry of a row is
    far below 0 and the width is not a power of two, e^{x − 0} underflows and the row is 0 / 0."""
    y = torch.empty_like(x)
    _softmax_zero_padded_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


def softmax_online_max_starts_at_zero(x, block=64):
    """Starts the running max at 0: right while some entry of each row is above about −80, 0 / 0 below."""
    y = torch.empty_like(x)
    _online_softmax_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=block, RESCALE=True, MAX_FROM_ZERO=True)
    return y


@triton.jit
def _cumsum_kernel(g_ptr, out_ptr, T, H, K, BT: tl.constexpr, BK: tl.constexpr):
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows, cols = chunk * BT + tl.arange(0, BT), tl.arange(0, BK)
    offsets = ((b * T + rows[:, None]) * H + h) * K + cols[None, :]
    mask = (rows[:, None] < T) & (cols[None, :] < K)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, tl.cumsum(g, axis=0), mask=mask)


def cumsum_in_the_input_dtype(g, chunk_size=64):
    """out = torch.empty_like(g): a bf16 g gets a bf16 G (the contract is fp32, whatever g's dtype)."""
    B, T, H, K = g.shape
    out = torch.empty_like(g)
    _cumsum_kernel[(triton.cdiv(T, chunk_size), B * H)](g.contiguous(), out, T, H, K, BT=chunk_size,
                                                         BK=triton.next_power_of_2(K))
    return out


@triton.jit
def _reverse_state_slip_kernel(q_ptr, k_ptr, gc_ptr, w_ptr, aqk_ptr, do_ptr, dht_ptr, dh_ptr, dvnew_ptr, dh0_ptr,
                               scale, T, H, K, V, NT, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                               IN_REVERSE: tl.constexpr, DECAY_STATE: tl.constexpr, STORE_LEAVING: tl.constexpr,
                               DELTA_TERM: tl.constexpr):
    """The reverse state pass with one of four slips: chunks walked first to last (IN_REVERSE=False), dS' carried
    without Diag(e^{G_C}) (DECAY_STATE=False), dh[c] stored after chunk c's update, i.e. the gradient of the state
    entering c (STORE_LEAVING=False), or the delta rule's −Wᵀ dṼ left out (DELTA_TERM=False)."""
    v_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    local, cols_k, cols_v = tl.arange(0, BT), tl.arange(0, BK), v_block * BV + tl.arange(0, BV)
    state_offsets = cols_k[:, None] * V + cols_v[None, :]
    state_mask = (cols_k[:, None] < K) & (cols_v[None, :] < V)
    grad_state = tl.load(dht_ptr + bh * K * V + state_offsets, mask=state_mask, other=0.0)
    for step in range(NT):
        chunk = NT - 1 - step if IN_REVERSE else step
        dh_offsets = ((b * NT + chunk) * H + h) * K * V + state_offsets
        if STORE_LEAVING:
            tl.store(dh_ptr + dh_offsets, grad_state, mask=state_mask)
        rows = chunk * BT + local
        token = (b * T + rows[:, None]) * H + h
        mask_k, mask_v = (rows[:, None] < T) & (cols_k[None, :] < K), (rows[:, None] < T) & (cols_v[None, :] < V)
        q = tl.load(q_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0)
        k = tl.load(k_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0)
        w = tl.load(w_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0)
        gc = tl.load(gc_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0)
        aqk = tl.load(aqk_ptr + token * BT + local[None, :], mask=rows[:, None] < T, other=0.0)
        grad_o = tl.load(do_ptr + token * V + cols_v[None, :], mask=mask_v, other=0.0)
        last = tl.minimum(chunk * BT + BT, T) - 1
        g_last = tl.load(gc_ptr + ((b * T + last) * H + h) * K + cols_k, mask=cols_k < K, other=0.0)
        grad_v_new = (tl.dot(tl.trans(aqk), grad_o, input_precision="ieee")
                      + tl.dot(k * tl.exp(g_last[None, :] - gc), grad_state, input_precision="ieee"))
        tl.store(dvnew_ptr + token * V + cols_v[None, :], grad_v_new, mask=mask_v)
        carried = grad_state * tl.exp(g_last)[:, None] if DECAY_STATE else grad_state
        grad_state = carried + tl.dot(tl.trans(q * tl.exp(gc) * scale), grad_o, input_precision="ieee")
        if DELTA_TERM:
            grad_state -= tl.dot(tl.trans(w), grad_v_new, input_precision="ieee")
        if not STORE_LEAVING:
            tl.store(dh_ptr + dh_offsets, grad_state, mask=state_mask)
    tl.store(dh0_ptr + bh * K * V + state_offsets, grad_state, mask=state_mask)


def _reverse_state_slip(q, k, gc, w, aqk, grad_o, grad_final_state, scale, **slip):
    B, T, H, K = q.shape
    V, C = grad_o.shape[-1], aqk.shape[-1]
    NT = triton.cdiv(T, C)
    grad_final_state = torch.zeros(B, H, K, V) if grad_final_state is None else grad_final_state
    grad_leaving, grad_v_new = torch.empty(B, NT, H, K, V), torch.empty(B, T, H, V)
    grad_initial = torch.empty(B, H, K, V)
    flags = dict(IN_REVERSE=True, DECAY_STATE=True, STORE_LEAVING=True, DELTA_TERM=True) | slip
    _reverse_state_slip_kernel[(triton.cdiv(V, 16), B * H)](
        q, k, gc, w, aqk, grad_o, grad_final_state, grad_leaving, grad_v_new, grad_initial, scale, T, H, K, V, NT,
        BT=C, BK=max(16, triton.next_power_of_2(K)), BV=16, **flags)
    return grad_leaving, grad_v_new, grad_initial


def reverse_pass_run_forward(q, k, gc, w, aqk, grad_o, grad_final_state, scale):
    """Walks the chunks first to last, as the forward does: chunk 0 gets dS_T, which belongs to the last chunk."""
    return _reverse_state_slip(q, k, gc, w, aqk, grad_o, grad_final_state, scale, IN_REVERSE=False)


def reverse_pass_without_the_decay(q, k, gc, w, aqk, grad_o, grad_final_state, scale):
    """dS = dS' + ... : forgets that S' = Diag(Γ_C) S + ..., so the gradient flows back undecayed."""
    return _reverse_state_slip(q, k, gc, w, aqk, grad_o, grad_final_state, scale, DECAY_STATE=False)


def reverse_pass_stores_one_chunk_late(q, k, gc, w, aqk, grad_o, grad_final_state, scale):
    """Stores dh[c] after chunk c's update: the gradient of the state entering c, one chunk off."""
    return _reverse_state_slip(q, k, gc, w, aqk, grad_o, grad_final_state, scale, STORE_LEAVING=False)


def reverse_pass_without_the_delta_term(q, k, gc, w, aqk, grad_o, grad_final_state, scale):
    """Leaves out −Wᵀ dṼ: right for a gated linear attention (Ṽ = V), not for the delta rule (Ṽ = U − W S)."""
    return _reverse_state_slip(q, k, gc, w, aqk, grad_o, grad_final_state, scale, DELTA_TERM=False)


def reverse_pass_with_the_default_scale(q, k, gc, w, aqk, grad_o, grad_final_state, scale):
    """Takes s = K^-1/2 for the (Γ ⊙ Q)ᵀ dO term instead of the scale it was given: right only at the default."""
    return _reverse_state_slip(q, k, gc, w, aqk, grad_o.contiguous(), grad_final_state, q.shape[-1] ** -0.5)


def reverse_pass_outputs_in_the_gradients_dtype(q, k, gc, w, aqk, grad_o, grad_final_state, scale):
    """Right values, returned in dO's dtype: bf16 gradients in, bf16 out, where fp32 is promised."""
    grad_final_state = None if grad_final_state is None else grad_final_state.float()
    outputs = _reverse_state_slip(q, k, gc, w, aqk, grad_o.float().contiguous(), grad_final_state, scale)
    return tuple(x.to(grad_o.dtype) for x in outputs)


def reverse_pass_reads_grad_o_as_contiguous(q, k, gc, w, aqk, grad_o, grad_final_state, scale):
    """Hands dO to the kernel as it came: a transposed gradient is then read in the wrong order."""
    grad_final_state = None if grad_final_state is None else grad_final_state.float()
    return _reverse_state_slip(q, k, gc, w, aqk, grad_o.float(), grad_final_state, scale)


def reverse_pass_in_torch(q, k, gc, w, aqk, grad_o, grad_final_state, scale):
    """The right recurrence, chunk by chunk in torch: right values, no kernel."""
    B, T, H, K = q.shape
    V, C = grad_o.shape[-1], aqk.shape[-1]
    grad_state = torch.zeros(B, H, K, V) if grad_final_state is None else grad_final_state.clone()
    leaving, grad_v_new = [], torch.empty(B, T, H, V)
    for start in reversed(range(0, T, C)):
        rows = slice(start, min(start + C, T))
        n = rows.stop - start
        g_last = gc[:, rows.stop - 1]  # [B, H, K]
        k_to_end = k[:, rows] * torch.exp(g_last[:, None] - gc[:, rows])
        leaving.insert(0, grad_state)
        dv = (torch.einsum("bthi,bthv->bihv", aqk[:, rows, :, :n], grad_o[:, rows])
              + torch.einsum("bthk,bhkv->bthv", k_to_end, grad_state))
        grad_v_new[:, rows] = dv
        grad_state = (grad_state * torch.exp(g_last)[..., None]
                      + scale * torch.einsum("bthk,bthv->bhkv", q[:, rows] * torch.exp(gc[:, rows]), grad_o[:, rows])
                      - torch.einsum("bthk,bthv->bhkv", w[:, rows], dv))
    return torch.stack(leaving, 1), grad_v_new, grad_state


@triton.jit
def _intra_chunk_slip_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, gc_ptr, aqk_ptr, w_ptr, u_ptr, scale, T, H, K, V,
                             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FACTORED: tl.constexpr,
                             SOLVE: tl.constexpr, DIAGONAL: tl.constexpr):
    """The intra-chunk step with one of three slips: the scores as (K e^G)(K e^{−G})ᵀ, which overflows once −G
    passes 88 (FACTORED), W and U without the UT solve, X = I (SOLVE=False), or A_qk without its diagonal, i ≤ r
    taken as i < r (DIAGONAL=False)."""
    chunk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    local, cols_k, cols_v = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    rows = chunk * BT + local
    token = (b * T + rows[:, None]) * H + h
    in_t = rows[:, None] < T
    mask_k, mask_v = in_t & (cols_k[None, :] < K), in_t & (cols_v[None, :] < V)
    q = tl.load(q_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + token * V + cols_v[None, :], mask=mask_v, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + (b * T + rows) * H + h, mask=rows < T, other=0.0).to(tl.float32)
    gc = tl.cumsum(tl.load(g_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0).to(tl.float32), axis=0)
    tl.store(gc_ptr + token * K + cols_k[None, :], gc, mask=mask_k)
    if FACTORED:
        keys_back = k * tl.exp(-gc)
        akk = tl.dot(k * tl.exp(gc), tl.trans(keys_back), input_precision="ieee")
        aqk = tl.dot(q * tl.exp(gc), tl.trans(keys_back), input_precision="ieee")
        akk = tl.where(local[:, None] > local[None, :], akk, 0.0)
        aqk = tl.where(local[:, None] >= local[None, :], aqk, 0.0)
    else:
        akk = tl.zeros([BT, BT], dtype=tl.float32)
        aqk = tl.zeros([BT, BT], dtype=tl.float32)
        for i in range(BT):
            pick = local[:, None] == i
            k_i = tl.sum(tl.where(pick, k, 0.0), axis=0)
            g_i = tl.sum(tl.where(pick, gc, 0.0), axis=0)
            decay = tl.exp(tl.where((local[:, None] >= i) & mask_k, gc - g_i[None, :], float("-inf")))
            column = local[None, :] == i
            akk = tl.where(column & (local[:, None] > i), tl.sum(k * k_i[None, :] * decay, axis=1)[:, None], akk)
            below = local[:, None] >= i if DIAGONAL else local[:, None] > i
            aqk = tl.where(column & below, tl.sum(q * k_i[None, :] * decay, axis=1)[:, None], aqk)
    tl.store(aqk_ptr + token * BT + local[None, :], aqk * scale, mask=in_t)
    akk = akk * beta[:, None]
    inverse = (local[:, None] == local[None, :]).to(tl.float32)
    if SOLVE:
        for r in range(1, BT):
            a_r = tl.sum(tl.where(local[:, None] == r, akk, 0.0), axis=0)
            x_r = tl.where(local == r, 1.0, 0.0) - tl.sum(a_r[:, None] * inverse, axis=0)
            inverse = tl.where(local[:, None] == r, x_r[None, :], inverse)
    w = tl.dot(inverse, k * tl.exp(gc) * beta[:, None], input_precision="ieee")
    u = tl.dot(inverse, v * beta[:, None], input_precision="ieee")
    tl.store(w_ptr + token * K + cols_k[None, :], w, mask=mask_k)
    tl.store(u_ptr + token * V + cols_v[None, :], u, mask=mask_v)


def _intra_chunk_slip(q, k, v, g, beta, scale, chunk_size, **slip):
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    gc, w = torch.empty(B, T, H, K), torch.empty(B, T, H, K)
    aqk, u = torch.empty(B, T, H, chunk_size), torch.empty(B, T, H, V)
    flags = dict(FACTORED=False, SOLVE=True, DIAGONAL=True) | slip
    _intra_chunk_slip_kernel[(triton.cdiv(T, chunk_size), B * H)](
        q, k, v, g, beta, gc, aqk, w, u, scale, T, H, K, V, BT=chunk_size, BK=max(16, triton.next_power_of_2(K)),
        BV=max(16, triton.next_power_of_2(V)), **flags)
    return gc, aqk, w, u


def intra_chunk_factored(q, k, v, g, beta, scale, chunk_size):
    """The scores as one product (K e^G)(K e^{−G})ᵀ: exact in exact arithmetic, inf/NaN once −G passes 88."""
    return _intra_chunk_slip(q, k, v, g, beta, scale, chunk_size, FACTORED=True)


def intra_chunk_without_the_solve(q, k, v, g, beta, scale, chunk_size):
    """W = β e^G ⊙ K and U = β V: the UT transform's inverse (I + A_kk)^-1 left out."""
    return _intra_chunk_slip(q, k, v, g, beta, scale, chunk_size, SOLVE=False)


def intra_chunk_strict_query_scores(q, k, v, g, beta, scale, chunk_size):
    """A_qk masked like A_kk (i < r): a token's output then misses its own key."""
    return _intra_chunk_slip(q, k, v, g, beta, scale, chunk_size, DIAGONAL=False)


def intra_chunk_in_torch(q, k, v, g, beta, scale, chunk_size):
    """The right factors from the package's chapter-07 torch code: right values, no kernel."""
    from k3course.ops import chunk as torch_chunk

    B, T, H, K = q.shape
    pad = -T % chunk_size
    chunks = [torch.nn.functional.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, pad)).reshape(
        B, -1, chunk_size, *x.shape[2:]).movedim(3, 1) for x in (q, k, v, g, beta)]
    qc, kc, vc, gc_chunks, bc = chunks
    G = gc_chunks.cumsum(-2)
    A_kk = torch_chunk.decayed_scores(kc, kc, G, strict=True) * bc.unsqueeze(-1)
    aqk = torch_chunk.decayed_scores(qc * scale, kc, G, strict=False)
    M = torch_chunk.ut_transform(A_kk, bc)
    back = lambda x: x.movedim(1, 3).reshape(B, -1, H, *x.shape[4:])[:, :T]  # noqa: E731
    return back(G), back(aqk), back(M @ (G.exp() * kc)), back(M @ vc)


@triton.jit
def _state_pass_slip_kernel(k_ptr, gc_ptr, w_ptr, u_ptr, h0_ptr, states_ptr, vnew_ptr, final_ptr, T, H, K, V, NT,
                            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr,
                            STORE_ENTERING: tl.constexpr, CORRECT: tl.constexpr):
    """The state pass with one of three slips: S not decayed by Diag(e^{G_C}) (DECAY=False), the state stored after
    the chunk's update, i.e. the one leaving it (STORE_ENTERING=False), or Ṽ = U, the delta rule's −W S left out
    (CORRECT=False)."""
    v_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    local, cols_k, cols_v = tl.arange(0, BT), tl.arange(0, BK), v_block * BV + tl.arange(0, BV)
    slice_offsets = cols_k[:, None] * V + cols_v[None, :]
    slice_mask = (cols_k[:, None] < K) & (cols_v[None, :] < V)
    state = tl.load(h0_ptr + bh * K * V + slice_offsets, mask=slice_mask, other=0.0)
    for chunk in range(NT):
        where = states_ptr + ((b * NT + chunk) * H + h) * K * V + slice_offsets
        if STORE_ENTERING:
            tl.store(where, state, mask=slice_mask)
        rows = chunk * BT + local
        token = (b * T + rows[:, None]) * H + h
        mask_k = (rows[:, None] < T) & (cols_k[None, :] < K)
        mask_v = (rows[:, None] < T) & (cols_v[None, :] < V)
        k = tl.load(k_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0)
        gc = tl.load(gc_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0)
        w = tl.load(w_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0)
        u = tl.load(u_ptr + token * V + cols_v[None, :], mask=mask_v, other=0.0)
        v_new = u - tl.dot(w, state, input_precision="ieee") if CORRECT else u
        tl.store(vnew_ptr + token * V + cols_v[None, :], v_new, mask=mask_v)
        end = tl.minimum(chunk * BT + BT, T) - 1
        g_end = tl.load(gc_ptr + ((b * T + end) * H + h) * K + cols_k, mask=cols_k < K, other=0.0)
        k_to_end = k * tl.exp(tl.where(mask_k, g_end[None, :] - gc, float("-inf")))
        carried = state * tl.exp(g_end)[:, None] if DECAY else state
        state = carried + tl.dot(tl.trans(k_to_end), v_new, input_precision="ieee")
        if not STORE_ENTERING:
            tl.store(where, state, mask=slice_mask)
    tl.store(final_ptr + bh * K * V + slice_offsets, state, mask=slice_mask)


def _state_pass_slip(k, gc, w, u, initial_state, chunk_size, **slip):
    k, gc, w, u = (x.contiguous() for x in (k, gc, w, u))
    B, T, H, K = k.shape
    V = u.shape[-1]
    NT = triton.cdiv(T, chunk_size)
    h0 = torch.zeros(B, H, K, V) if initial_state is None else initial_state
    states, v_new, final = torch.empty(B, NT, H, K, V), torch.empty(B, T, H, V), torch.empty(B, H, K, V)
    flags = dict(DECAY=True, STORE_ENTERING=True, CORRECT=True) | slip
    _state_pass_slip_kernel[(triton.cdiv(V, 16), B * H)](k, gc, w, u, h0, states, v_new, final, T, H, K, V, NT,
                                                         BT=chunk_size, BK=max(16, triton.next_power_of_2(K)), BV=16,
                                                         **flags)
    return states, v_new, final


def state_pass_without_the_decay(k, gc, w, u, initial_state, chunk_size):
    """S ← S + K̃ᵀ Ṽ: forgets that the state fades by e^{G_C} over the chunk."""
    return _state_pass_slip(k, gc, w, u, initial_state, chunk_size, DECAY=False)


def state_pass_stores_the_leaving_state(k, gc, w, u, initial_state, chunk_size):
    """Stores S after chunk c's update: the state leaving c where the one entering it is asked."""
    return _state_pass_slip(k, gc, w, u, initial_state, chunk_size, STORE_ENTERING=False)


def state_pass_without_the_correction(k, gc, w, u, initial_state, chunk_size):
    """Ṽ = U: the delta rule's correction −W S left out (right for a gated linear attention, not for KDA)."""
    return _state_pass_slip(k, gc, w, u, initial_state, chunk_size, CORRECT=False)


def state_pass_in_torch(k, gc, w, u, initial_state, chunk_size):
    """The right recurrence chunk by chunk in torch: right values, no kernel."""
    B, T, H, K = k.shape
    state = torch.zeros(B, H, K, u.shape[-1]) if initial_state is None else initial_state.clone()
    entering, v_new = [], torch.empty(u.shape)
    for start in range(0, T, chunk_size):
        rows = slice(start, min(start + chunk_size, T))
        entering.append(state)
        corrected = u[:, rows] - torch.einsum("bthk,bhkv->bthv", w[:, rows], state)
        v_new[:, rows] = corrected
        g_end = gc[:, rows.stop - 1]
        state = (state * torch.exp(g_end)[..., None]
                 + torch.einsum("bthk,bthv->bhkv", k[:, rows] * torch.exp(g_end[:, None] - gc[:, rows]), corrected))
    return torch.stack(entering, 1), v_new, state


@triton.jit
def _output_slip_kernel(q_ptr, gc_ptr, states_ptr, vnew_ptr, aqk_ptr, o_ptr, scale, T, H, K, V, NT,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY_Q: tl.constexpr,
                        SCALE_Q: tl.constexpr, INTRA: tl.constexpr):
    """The output with one of three slips: Q read without its decay e^G from the chunk's start (DECAY_Q=False), the
    state's term without the scale (SCALE_Q=False), or the intra-chunk term A_qk Ṽ left out (INTRA=False)."""
    v_block, chunk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    local, cols_k, cols_v = tl.arange(0, BT), tl.arange(0, BK), v_block * BV + tl.arange(0, BV)
    rows = chunk * BT + local
    token = (b * T + rows[:, None]) * H + h
    mask_k = (rows[:, None] < T) & (cols_k[None, :] < K)
    mask_v = (rows[:, None] < T) & (cols_v[None, :] < V)
    q = tl.load(q_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0).to(tl.float32)
    gc = tl.load(gc_ptr + token * K + cols_k[None, :], mask=mask_k, other=0.0)
    aqk = tl.load(aqk_ptr + token * BT + local[None, :], mask=rows[:, None] < T, other=0.0)
    v_new = tl.load(vnew_ptr + token * V + cols_v[None, :], mask=mask_v, other=0.0)
    state = tl.load(states_ptr + ((b * NT + chunk) * H + h) * K * V + cols_k[:, None] * V + cols_v[None, :],
                    mask=(cols_k[:, None] < K) & (cols_v[None, :] < V), other=0.0)
    if DECAY_Q:
        q = q * tl.exp(gc)
    if SCALE_Q:
        q = q * scale
    out = tl.dot(q, state, input_precision="ieee")
    if INTRA:
        out += tl.dot(aqk, v_new, input_precision="ieee")
    tl.store(o_ptr + token * V + cols_v[None, :], out, mask=mask_v)


def _output_slip(q, gc, states, v_new, aqk, scale, **slip):
    q, gc, states, v_new, aqk = (x.contiguous() for x in (q, gc, states, v_new, aqk))
    B, T, H, K = q.shape
    V, NT, C = v_new.shape[-1], states.shape[1], aqk.shape[-1]
    o = torch.empty(B, T, H, V)
    flags = dict(DECAY_Q=True, SCALE_Q=True, INTRA=True) | slip
    _output_slip_kernel[(triton.cdiv(V, 16), NT, B * H)](q, gc, states, v_new, aqk, o, scale, T, H, K, V, NT, BT=C,
                                                        BK=max(16, triton.next_power_of_2(K)), BV=16, **flags)
    return o


def output_without_the_query_decay(q, gc, states, v_new, aqk, scale):
    """Q S: forgets that the state entering the chunk has faded by e^{G_t} by token t."""
    return _output_slip(q, gc, states, v_new, aqk, scale, DECAY_Q=False)


def output_without_the_scale(q, gc, states, v_new, aqk, scale):
    """(e^G ⊙ Q) S without s: A_qk arrives scaled, the state's term must be scaled by hand."""
    return _output_slip(q, gc, states, v_new, aqk, scale, SCALE_Q=False)


def output_without_the_intra_chunk_term(q, gc, states, v_new, aqk, scale):
    """Only the state's term: the chunk's own tokens (A_qk Ṽ) left out."""
    return _output_slip(q, gc, states, v_new, aqk, scale, INTRA=False)


def output_in_torch(q, gc, states, v_new, aqk, scale):
    """The right output from chunk-shaped torch products: right values, no kernel."""
    B, T, H, K = q.shape
    C = aqk.shape[-1]
    o = torch.empty(v_new.shape)
    for c, start in enumerate(range(0, T, C)):
        rows = slice(start, min(start + C, T))
        n = rows.stop - start
        o[:, rows] = (scale * torch.einsum("bthk,bhkv->bthv", q[:, rows].float() * torch.exp(gc[:, rows]), states[:, c])
                      + torch.einsum("bthi,bihv->bthv", aqk[:, rows, :, :n], v_new[:, rows]))
    return o


def composed_with_the_factored_scores(q, k, v, g, beta, **kwargs):
    """The three kernels composed, the intra-chunk one forming the scores as one overflowing product."""
    return kda_chunk_from_kernels(intra_chunk_factored, state_pass, output_from_states)(q, k, v, g, beta, **kwargs)


def composed_with_an_undecayed_state(q, k, v, g, beta, **kwargs):
    """The three kernels composed, the state pass forgetting Diag(e^{G_C})."""
    return kda_chunk_from_kernels(intra_chunk_factors, state_pass_without_the_decay, output_from_states)(
        q, k, v, g, beta, **kwargs)


def composed_ignoring_the_lower_bound(q, k, v, g, beta, lower_bound=None, **kwargs):
    """Right kernels, but the gate's lower bound never applied: g below −5 decays faster than K3's layer allows."""
    return kda_chunk_from_kernels()(q, k, v, g, beta, **kwargs)


@triton.jit
def _grouped_gemm_slip_kernel(x_ptr, w_ptr, out_ptr, ends_ptr, N, K, stride_xm, stride_we, stride_wk, stride_wn,
                              stride_om, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              MASK_FIRST_START: tl.constexpr, WEIGHT_STRIDES: tl.constexpr,
                              MASK_COLUMNS: tl.constexpr):
    """The grouped GEMM with one of three slips: group 0's start read from ends[−1], before the offsets, instead
    of 0 (MASK_FIRST_START=False); the bank read as a contiguous [E, K, N] whatever its strides
    (WEIGHT_STRIDES=False); the store masked by rows only (MASK_COLUMNS=False)."""
    expert, row_block, col_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if MASK_FIRST_START:
        group_start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    else:
        group_start = tl.load(ends_ptr + expert - 1).to(tl.int64)
    group_end = tl.load(ends_ptr + expert).to(tl.int64)
    tile_start = group_start + row_block * BM
    if tile_start < group_end:
        rows = tile_start + tl.arange(0, BM)
        cols = col_block * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            depth = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + depth[None, :],
                        mask=(rows < group_end)[:, None] & (depth < K)[None, :], other=0.0)
            if WEIGHT_STRIDES:
                w_offsets = expert * stride_we + depth[:, None] * stride_wk + cols[None, :] * stride_wn
            else:
                w_offsets = (expert * K + depth[:, None]) * N + cols[None, :]
            w = tl.load(w_ptr + w_offsets, mask=(depth < K)[:, None] & (cols < N)[None, :], other=0.0)
            acc += tl.dot(x, w, input_precision="ieee")
        mask = (rows < group_end)[:, None] & (cols < N)[None, :] if MASK_COLUMNS else (rows < group_end)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=mask)


def _grouped_gemm_slip(x_sorted, expert_weights, group_offsets, row_blocks=None, block=16, **slip):
    """Launches the slip kernel over (E, row blocks, column blocks); ``row_blocks`` defaults to ⌈M / block⌉."""
    x_sorted = x_sorted.contiguous()
    (M, K), (E, _, N) = x_sorted.shape, expert_weights.shape
    out = torch.empty(M, N, dtype=x_sorted.dtype)
    rows = triton.cdiv(M, block) if row_blocks is None else row_blocks
    flags = dict(MASK_FIRST_START=True, WEIGHT_STRIDES=True, MASK_COLUMNS=True) | slip
    _grouped_gemm_slip_kernel[(E, rows, triton.cdiv(N, block))](
        x_sorted, expert_weights, out, group_offsets, N, K, x_sorted.stride(0), *expert_weights.stride(),
        out.stride(0), BM=block, BN=block, BK=block, **flags)
    return out


def grouped_gemm_reads_before_the_offsets(x_sorted, expert_weights, group_offsets):
    """Group e starts at ends[e − 1], for e = 0 too: expert 0's start is whatever lies before the offsets tensor,
    and its rows are written from there (before the output's start)."""
    return _grouped_gemm_slip(x_sorted, expert_weights, group_offsets, MASK_FIRST_START=False)


def grouped_gemm_one_tile_per_expert(x_sorted, expert_weights, group_offsets):
    """One row block per expert: an expert with more rows than a tile leaves the rest unwritten."""
    return _grouped_gemm_slip(x_sorted, expert_weights, group_offsets, row_blocks=1)


def grouped_gemm_assumes_a_contiguous_bank(x_sorted, expert_weights, group_offsets):
    """Reads weight (e, k, n) at (e·K + k)·N + n: right for a contiguous bank, wrong for a transposed view."""
    return _grouped_gemm_slip(x_sorted, expert_weights, group_offsets, WEIGHT_STRIDES=False)


def grouped_gemm_store_masks_rows_only(x_sorted, expert_weights, group_offsets):
    """Masks the store's rows but not its columns: with N no multiple of the block, each row's last block spills
    into the next row, and the last row's past the output's end. The values the next row's programs rewrite
    hide it, except at the end."""
    return _grouped_gemm_slip(x_sorted, expert_weights, group_offsets, MASK_COLUMNS=False)


def grouped_gemm_offsets_on_the_host(x_sorted, expert_weights, group_offsets):
    """Right kernel per expert, launched from the group sizes read back to the host (a stall per call on a GPU)."""
    ends = group_offsets.tolist()
    out = torch.empty(x_sorted.shape[0], expert_weights.shape[2])
    for e, (start, end) in enumerate(zip([0, *ends], ends)):
        if end > start:
            out[start:end] = matmul_without_the_k_loop(x_sorted[start:end], expert_weights[e], block=64)
    return out


def grouped_gemm_in_torch(x_sorted, expert_weights, group_offsets):
    """The right products, one torch matmul per expert."""
    starts = torch.cat([group_offsets.new_zeros(1), group_offsets[:-1]])
    return torch.cat([x_sorted[s:e] @ expert_weights[i] for i, (s, e) in enumerate(zip(starts, group_offsets))])


WRONG = {
    "08.grouped_gemm": [grouped_gemm_reads_before_the_offsets, grouped_gemm_one_tile_per_expert,
                        grouped_gemm_assumes_a_contiguous_bank, grouped_gemm_store_masks_rows_only,
                        grouped_gemm_offsets_on_the_host, grouped_gemm_in_torch],
    "08.kda_decode": [decode_returns_a_new_state, decode_in_torch],
    "08.softmax_rows": [softmax_without_the_max, softmax_padded_with_zeros, softmax_max_includes_the_padding],
    "08.softmax_online": [softmax_online_without_rescaling, softmax_online_max_starts_at_zero],
    "08.scale_add": [scale_add_alpha_on_y, scale_add_one_program, scale_add_in_torch],
    "08.matmul": [matmul_without_the_k_loop, matmul_in_torch],
    "08.l2norm_rows": [l2norm_in_torch, l2norm_eps_outside_sqrt, l2norm_unmasked_store_crashes,
                      l2norm_store_runs_past_the_end],
    "08.chunk_cumsum": [cumsum_one_chunk_for_all, cumsum_in_the_input_dtype],
    "08.kk_tile": [tile_factored_naively, tile_always_16_wide, tile_in_torch],
    "08.kda_chunk": [composed_with_the_factored_scores, composed_with_an_undecayed_state,
                     composed_ignoring_the_lower_bound],
    "08.kda_intra_chunk": [intra_chunk_factored, intra_chunk_without_the_solve, intra_chunk_strict_query_scores,
                           intra_chunk_in_torch],
    "08.kda_state_pass": [state_pass_without_the_decay, state_pass_stores_the_leaving_state,
                          state_pass_without_the_correction, state_pass_in_torch],
    "08.kda_chunk_output": [output_without_the_query_decay, output_without_the_scale,
                            output_without_the_intra_chunk_term, output_in_torch],
    "08.reverse_state_pass": [reverse_pass_run_forward, reverse_pass_without_the_decay,
                              reverse_pass_stores_one_chunk_late, reverse_pass_without_the_delta_term,
                              reverse_pass_in_torch, reverse_pass_with_the_default_scale,
                              reverse_pass_outputs_in_the_gradients_dtype, reverse_pass_reads_grad_o_as_contiguous],
}
