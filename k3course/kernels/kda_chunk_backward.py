"""The backward of chunkwise KDA as Triton kernels (lesson 08): the gradients of q, k, v, g, β and the initial
state from the gradient of the output and of the final state.

Per chunk (one head, C tokens, s the scale, S the state entering the chunk and S' the state leaving it, Γ = e^G,
K̃ = K ⊙ e^{G_C − G}, D[r,i] = Σ_d k_rd k_id e^{G_rd − G_id} (i < r), A_kk = Diag(β) D, X = (I + A_kk)^-1,
M = X Diag(β), R = V − (Γ ⊙ K) S, so that Ṽ = M R, O = s (Γ ⊙ Q) S + A_qk Ṽ, S' = Diag(Γ_C) S + K̃ᵀ Ṽ):

1. ``_reverse_state_kernel``  the only sequential part, chunks from the last to the first: the state leaving a
                              chunk feeds every later chunk, so its gradient dS' is complete only once all later
                              chunks are done. With dS' known (the final state's gradient for the last chunk):
                              dṼ = A_qkᵀ dO + K̃ dS',  dS = s (Γ ⊙ Q)ᵀ dO + Diag(Γ_C) dS' − Wᵀ dṼ,
                              and dS is dS' of the chunk before (for the first: the initial state's gradient).
2. ``_chunk_gradient_kernel`` every chunk in parallel, from S, dS', Ṽ and dṼ:
                              Y = Xᵀ dṼ, Z = Y Sᵀ,  dV = Diag(β) Y,
                              dA_qk = s tril(dO Ṽᵀ),  dA_kk = −strict_tril(Y Ṽᵀ),
                              dβ = Σ_v V ⊙ Y − Σ_d (Γ ⊙ K) ⊙ Z + Σ_i dA_kk ⊙ D,
                              the gradients of the decayed scores (rows q_r, k_r, columns k_i) column by column,
                              dG = Q ⊙ dQ + K ⊙ (dK₊ − dK₋) (G enters the rows with +, the columns and K̃ with −),
                              dG_C += Σ_v S' ⊙ dS', and dg_t = Σ_{r ≥ t} dG_r + dG_C within the chunk.

The forward keeps only its inputs; the backward recomputes G, A_kk, A_qk, W, the chunk states and Ṽ with the
forward kernels (cheap next to storing a K × V state per chunk) and hands them to :func:`kda_chunk_backward`
(the reverse pass alone: :func:`reverse_state_pass`, one of the exercises of chapter 08).
Everything accumulates in fp32; the gradients are returned in fp32.
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3course.kernels.chunk_tiles import block_width, dot_fp32, low_precision, tile_offsets, unit_lower_inverse  # noqa: E402

BACKWARD_STAGES = 2  # software-pipelining depth of both kernels: the default 3 needs 353 KB (reverse pass) and
# 299 KB (chunk gradients, before key blocks) of shared memory in fp32 at C = 64, K = 128; an H100 / H200 has 227 KB
GRADIENT_KEY_BLOCK = 32  # channels per program of the chunk-gradient kernel: [C, 32] fp32 tiles stay in registers


@triton.jit
def _reverse_state_kernel(q_ptr, k_ptr, gc_ptr, w_ptr, aqk_ptr, do_ptr, dht_ptr, dh_ptr, dvnew_ptr, dh0_ptr, scale,
                          T, H, K, V, NT, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          USE_FINAL_STATE_GRADIENT: tl.constexpr, STORE_INITIAL_STATE_GRADIENT: tl.constexpr,
                          LOW_PRECISION: tl.constexpr):
    """One program per (value block, batch·head), walking the chunks from the last to the first.

    For chunk c with dS' [K, BV] the gradient of the state leaving it: store dS' in dh[b, c, h], then
    dṼ = A_qkᵀ dO + K̃ dS' (stored) and dS' ← s (e^G ⊙ Q)ᵀ dO + Diag(e^{G_last}) dS' − Wᵀ dṼ.
    """
    v_block, bh = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # int64 offsets, as in the forward kernels
    b, h = bh // H, bh % H
    cols_k = tl.arange(0, BK)
    cols_v = v_block * BV + tl.arange(0, BV)
    local = tl.arange(0, BT)
    state_offsets = cols_k[:, None] * V + cols_v[None, :]  # [BK, BV] inside one [K, V] state
    state_mask = (cols_k[:, None] < K) & (cols_v[None, :] < V)
    grad_state = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        grad_state += tl.load(dht_ptr + bh * K * V + state_offsets, mask=state_mask, other=0.0)
    for step in range(NT):
        chunk = NT - 1 - step
        tl.store(dh_ptr + ((b * NT + chunk) * H + h) * K * V + state_offsets, grad_state, mask=state_mask)
        rows = chunk * BT + local
        k_offsets, mask_k = tile_offsets(b, h, T, H, rows, cols_k, K)
        v_offsets, mask_v = tile_offsets(b, h, T, H, rows, cols_v, V)
        a_offsets, mask_a = tile_offsets(b, h, T, H, rows, local, BT)
        q = tl.load(q_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
        gc = tl.load(gc_ptr + k_offsets, mask=mask_k, other=0.0)
        aqk = tl.load(aqk_ptr + a_offsets, mask=mask_a, other=0.0).to(tl.float32)
        grad_o = tl.load(do_ptr + v_offsets, mask=mask_v, other=0.0).to(tl.float32)
        last = tl.minimum(chunk * BT + BT, T) - 1
        g_last = tl.load(gc_ptr + ((b * T + last) * H + h) * K + cols_k, mask=cols_k < K, other=0.0)  # [BK]
        k_to_end = k * tl.exp(tl.where(mask_k, g_last[None, :] - gc, float("-inf")))  # K̃, exponents ≤ 0
        grad_v_new = dot_fp32(tl.trans(aqk), grad_o, LOW_PRECISION) + dot_fp32(k_to_end, grad_state, LOW_PRECISION)
        tl.store(dvnew_ptr + v_offsets, grad_v_new, mask=mask_v)
        scaled_q = (q * tl.exp(gc) * scale).to(tl.float32)  # fp32: a compiled graph may pass scale as fp64
        grad_state = (grad_state * tl.exp(g_last)[:, None] + dot_fp32(tl.trans(scaled_q), grad_o, LOW_PRECISION)
                      - dot_fp32(tl.trans(w), grad_v_new, LOW_PRECISION))
    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0_ptr + bh * K * V + state_offsets, grad_state, mask=state_mask)


@triton.jit
def _chunk_gradient_kernel(q_ptr, k_ptr, v_ptr, gc_ptr, beta_ptr, akk_ptr, aqk_ptr, h_ptr, vnew_ptr, do_ptr, dh_ptr,
                           dvnew_ptr, dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr, scale, T, H, K, V, NT,
                           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """One program per (key block, chunk, batch·head): dq, dk, dg of the chunk's BK channels, dv (written by key
    block 0) and this key block's share of dβ (dbeta[key block], summed by the caller); see the module docstring.

    Every channel's gradients need only that channel (and the [BT, BT] matrices dO Ṽᵀ and Y Ṽᵀ, which each key
    block forms again), so the key dimension is split: a program holds [BT, BK] tiles, not [BT, K]. The value
    dimension is walked in blocks of BV, accumulating the products that sum over it; then the scores' gradients
    column by column (:func:`_score_gradients`) and the decay's.
    """
    k_block, chunk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = bh.to(tl.int64)
    b, h = bh // H, bh % H
    local = tl.arange(0, BT)
    rows = chunk * BT + local
    cols_k = k_block * BK + tl.arange(0, BK)
    k_offsets, mask_k = tile_offsets(b, h, T, H, rows, cols_k, K)
    k = tl.load(k_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
    gc = tl.load(gc_ptr + k_offsets, mask=mask_k, other=0.0)
    beta = tl.load(beta_ptr + (b * T + rows) * H + h, mask=rows < T, other=0.0).to(tl.float32)
    last = tl.minimum(chunk * BT + BT, T) - 1
    g_last = tl.load(gc_ptr + ((b * T + last) * H + h) * K + cols_k, mask=cols_k < K, other=0.0)  # [BK]
    to_end = tl.exp(tl.where(mask_k, g_last[None, :] - gc, float("-inf")))  # e^{G_C − G} [BT, BK]
    inverse = unit_lower_inverse(akk_ptr, b, h, T, H, chunk, BT)  # X [BT, BT]
    grad_aqk = tl.zeros([BT, BT], dtype=tl.float32)  # dO Ṽᵀ
    y_v_new = tl.zeros([BT, BT], dtype=tl.float32)  # Y Ṽᵀ
    grad_q_state = tl.zeros([BT, BK], dtype=tl.float32)  # dO Sᵀ
    grad_k_to_end = tl.zeros([BT, BK], dtype=tl.float32)  # dK̃ = Ṽ dS'ᵀ
    y_state = tl.zeros([BT, BK], dtype=tl.float32)  # Z = Y Sᵀ
    grad_beta = tl.zeros([BT], dtype=tl.float32)
    grad_g_last = tl.zeros([BK], dtype=tl.float32)  # Σ_v S' ⊙ dS'
    for v0 in range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_offsets, mask_v = tile_offsets(b, h, T, H, rows, cols_v, V)
        state_offsets = ((b * NT + chunk) * H + h) * K * V + cols_k[:, None] * V + cols_v[None, :]
        state_mask = (cols_k[:, None] < K) & (cols_v[None, :] < V)
        state = tl.load(h_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32)  # S [BK, BV]
        grad_leaving = tl.load(dh_ptr + state_offsets, mask=state_mask, other=0.0)  # dS' [BK, BV]
        v = tl.load(v_ptr + v_offsets, mask=mask_v, other=0.0).to(tl.float32)
        v_new = tl.load(vnew_ptr + v_offsets, mask=mask_v, other=0.0).to(tl.float32)
        grad_o = tl.load(do_ptr + v_offsets, mask=mask_v, other=0.0).to(tl.float32)
        grad_v_new = tl.load(dvnew_ptr + v_offsets, mask=mask_v, other=0.0)
        y = dot_fp32(tl.trans(inverse), grad_v_new, LOW_PRECISION)  # Y = Xᵀ dṼ [BT, BV]
        tl.store(dv_ptr + v_offsets, y * beta[:, None], mask=mask_v & (k_block == 0))
        grad_aqk += dot_fp32(grad_o, tl.trans(v_new), LOW_PRECISION)
        y_v_new += dot_fp32(y, tl.trans(v_new), LOW_PRECISION)
        grad_q_state += dot_fp32(grad_o, tl.trans(state), LOW_PRECISION)
        grad_k_to_end += dot_fp32(v_new, tl.trans(grad_leaving), LOW_PRECISION)
        y_state += dot_fp32(y, tl.trans(state), LOW_PRECISION)
        grad_beta += tl.where(k_block == 0, tl.sum(v * y, axis=1), 0.0)  # Σ_v V ⊙ Y, counted once
        leaving = state * tl.exp(g_last)[:, None] + dot_fp32(tl.trans(k * to_end), v_new, LOW_PRECISION)  # S'
        grad_g_last += tl.sum(leaving * grad_leaving, axis=1)
    q = tl.load(q_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
    grad_aqk = tl.where(local[:, None] >= local[None, :], grad_aqk * scale, 0.0)  # of the unscaled q scores
    grad_akk = tl.where(local[:, None] > local[None, :], -y_v_new, 0.0)  # dA_kk; dD = Diag(β) dA_kk
    grad_q_rows, grad_k_rows, grad_k_columns = _score_gradients(q, k, gc, beta, grad_aqk, grad_akk, k_ptr, gc_ptr,
                                                                cols_k, b, h, T, H, K, chunk, BT, BK)
    decay = tl.where(mask_k, tl.exp(gc), 0.0)  # Γ
    grad_beta += tl.sum(k * grad_k_rows - decay * k * y_state, axis=1)
    grad_q = grad_q_rows + decay * grad_q_state * scale
    grad_k_plus = beta[:, None] * (grad_k_rows - decay * y_state)  # where G enters with +: rows of D, Γ ⊙ K
    grad_k_minus = grad_k_columns + to_end * grad_k_to_end  # where G enters with −: columns of D and A_qk, K̃
    grad_decay = q * grad_q + k * (grad_k_plus - grad_k_minus)  # dG [BT, BK]
    grad_g = tl.cumsum(grad_decay, axis=0, reverse=True) + grad_g_last[None, :]  # Σ_{r ≥ t} dG_r + dG_C
    tl.store(dq_ptr + k_offsets, grad_q, mask=mask_k)
    tl.store(dk_ptr + k_offsets, grad_k_plus + grad_k_minus, mask=mask_k)
    tl.store(dg_ptr + k_offsets, grad_g, mask=mask_k)
    share = k_block.to(tl.int64) * tl.num_programs(2) * T  # dbeta is [key blocks, B, T, H]; B·H programs on axis 2
    tl.store(dbeta_ptr + share + (b * T + rows) * H + h, grad_beta, mask=rows < T)


@triton.jit
def _score_gradients(q, k, gc, beta, grad_aqk, grad_akk, k_ptr, gc_ptr, cols_k, b, h, T, H, K, chunk,
                     BT: tl.constexpr, BK: tl.constexpr):
    """The gradients of the decayed scores P_q[r,i] = Σ_d q_rd k_id e^{G_rd − G_id} (i ≤ r) and D[r,i] (the same
    with k_r, i < r), for upstream dP_q = ``grad_aqk`` and dD = Diag(β) ``grad_akk``, one column i at a time:

        rows:     dq_r += dP_q[r,i] k_i ⊙ e^{G_r − G_i},   R_r += dA_kk[r,i] k_i ⊙ e^{G_r − G_i}   (dk_r = β_r R_r),
        columns:  dk_i = Σ_{r ≥ i} (dP_q[r,i] q_r + β_r dA_kk[r,i] k_r) ⊙ e^{G_r − G_i}.

    Every exponent is G_r − G_i ≤ 0 (r ≥ i; the others are masked to −inf), so nothing overflows for any g ≤ 0.
    R is returned without β (dβ needs Σ_d k ⊙ R, which is Σ_i dA_kk ⊙ D). Each channel d needs only its own
    k, q, G: the tiles are the key block ``cols_k``. Returns dq, R, dk_columns [BT, BK].
    """
    local = tl.arange(0, BT)
    rows_valid = (chunk * BT + local)[:, None] < T
    grad_q_rows = tl.zeros([BT, BK], dtype=tl.float32)
    grad_k_rows = tl.zeros([BT, BK], dtype=tl.float32)
    grad_k_columns = tl.zeros([BT, BK], dtype=tl.float32)
    for i in range(BT):  # a runtime loop, as in the forward's diagonal tiles
        row_i = chunk * BT + i
        mask_i = (cols_k < K) & (row_i < T)
        k_i = tl.load(k_ptr + ((b * T + row_i) * H + h) * K + cols_k, mask=mask_i, other=0.0).to(tl.float32)
        g_i = tl.load(gc_ptr + ((b * T + row_i) * H + h) * K + cols_k, mask=mask_i, other=0.0)
        at_or_below = (local[:, None] >= i) & rows_valid & mask_i[None, :]
        weight = tl.exp(tl.where(at_or_below, gc - g_i[None, :], float("-inf")))  # e^{G_r − G_i} [BT, BK]
        is_column = local[None, :] == i
        grad_aqk_i = tl.sum(tl.where(is_column, grad_aqk, 0.0), axis=1)  # [BT] column i of dP_q
        grad_akk_i = tl.sum(tl.where(is_column, grad_akk, 0.0), axis=1)
        k_i_weighted = k_i[None, :] * weight
        grad_q_rows += grad_aqk_i[:, None] * k_i_weighted
        grad_k_rows += grad_akk_i[:, None] * k_i_weighted
        column = tl.sum((grad_aqk_i[:, None] * q + (grad_akk_i * beta)[:, None] * k) * weight, axis=0)  # [BK]
        grad_k_columns = tl.where(local[:, None] == i, column[None, :], grad_k_columns)
    return grad_q_rows, grad_k_rows, grad_k_columns


def reverse_state_pass(q, k, gc, w, aqk, grad_o, grad_final_state, scale: float, initial_state_gradient: bool = True):
    """The backward's one sequential part (``_reverse_state_kernel``), chunks from the last to the first: with dS'
    the gradient of the state leaving chunk c (the final state's gradient for the last chunk, 0 when it is None),

        dṼ_c = A_qkᵀ dO_c + K̃_c dS',   dS = s (Γ ⊙ Q_c)ᵀ dO_c + Diag(Γ_C) dS' − W_cᵀ dṼ_c,   K̃ = K ⊙ e^{G_C − G},

    and dS is dS' of chunk c − 1. It needs no state and no Ṽ: only what the forward kernels recompute (G, W, A_qk)
    and the upstream gradients.

    q, k, gc (in-chunk cumulative log-decay, fp32), w: [B, T, H, K]; aqk (scaled): [B, T, H, C], C the chunk size;
    grad_o: [B, T, H, V]; grad_final_state: [B, H, K, V] or None. Returns fp32 (dS' of every chunk
    [B, NT, H, K, V], dṼ [B, T, H, V], the initial state's gradient [B, H, K, V], or None unless
    ``initial_state_gradient``).
    """
    B, T, H, K = q.shape
    V, chunk_size = grad_o.shape[-1], aqk.shape[-1]
    if tuple(grad_o.shape[:3]) != (B, T, H) or tuple(aqk.shape[:3]) != (B, T, H):
        raise ValueError(f"grad_o and aqk must be [B, T, H, ·] = [{B}, {T}, {H}, ·] like q, got "
                         f"{tuple(grad_o.shape)} and {tuple(aqk.shape)}")
    if grad_final_state is not None and tuple(grad_final_state.shape) != (B, H, K, V):
        raise ValueError(f"grad_final_state must be [B, H, K, V] = {(B, H, K, V)} or None, "
                         f"got {tuple(grad_final_state.shape)}")
    NT = triton.cdiv(T, chunk_size)
    fp32 = dict(dtype=torch.float32, device=q.device)
    grad_leaving, grad_v_new = torch.empty(B, NT, H, K, V, **fp32), torch.empty(B, T, H, V, **fp32)
    grad_initial = torch.empty(B, H, K, V, **fp32) if initial_state_gradient else None
    dht = grad_final_state.to(torch.float32).contiguous() if grad_final_state is not None else None
    BV = min(32, block_width(V))  # narrow value blocks, as in the forward's state kernel
    _reverse_state_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, gc, w, aqk, grad_o.contiguous(), dht, grad_leaving, grad_v_new, grad_initial, scale, T, H, K, V, NT,
        BT=chunk_size, BK=block_width(K), BV=BV, USE_FINAL_STATE_GRADIENT=dht is not None,
        STORE_INITIAL_STATE_GRADIENT=initial_state_gradient, LOW_PRECISION=low_precision(q),
        num_stages=BACKWARD_STAGES)
    return grad_leaving, grad_v_new, grad_initial


def kda_chunk_backward(q, k, v, gc, beta, akk, aqk, w, states, v_new, grad_o, grad_final_state, scale: float,
                       chunk_size: int, initial_state_gradient: bool):
    """The gradients of chunkwise KDA from the forward's intermediates, two Triton kernels: the reverse state pass
    (:func:`reverse_state_pass`), then every chunk's gradients in parallel.

    q, k: [B, T, H, K]; v, grad_o: [B, T, H, V]; beta: [B, T, H]; gc (in-chunk cumulative log-decay, fp32),
    w: [B, T, H, K]; akk (β-scaled), aqk (scaled): [B, T, H, C]; states (entering each chunk): [B, NT, H, K, V];
    v_new (Ṽ): [B, T, H, V]; grad_final_state: [B, H, K, V] or None (no gradient reaches the final state).
    Returns fp32 (dq, dk, dv, dg, dβ, dS_0) with dS_0 [B, H, K, V] or None unless ``initial_state_gradient``.
    """
    B, T, H, K = q.shape
    V, NT = v.shape[-1], states.shape[1]
    fp32 = dict(dtype=torch.float32, device=q.device)
    grad_o = grad_o.contiguous()
    grad_leaving, grad_v_new, grad_initial = reverse_state_pass(q, k, gc, w, aqk, grad_o, grad_final_state, scale,
                                                                initial_state_gradient)
    grad_q, grad_k, grad_g = (torch.empty(B, T, H, K, **fp32) for _ in range(3))
    key_block = min(GRADIENT_KEY_BLOCK, block_width(K))
    key_blocks = triton.cdiv(K, key_block)
    grad_v, grad_beta = torch.empty(B, T, H, V, **fp32), torch.empty(key_blocks, B, T, H, **fp32)
    _chunk_gradient_kernel[(key_blocks, NT, B * H)](
        q, k, v, gc, beta, akk, aqk, states, v_new, grad_o, grad_leaving, grad_v_new, grad_q, grad_k, grad_v, grad_g,
        grad_beta, scale, T, H, K, V, NT, BT=chunk_size, BK=key_block, BV=min(64, block_width(V)),
        LOW_PRECISION=low_precision(q), num_stages=BACKWARD_STAGES)
    grad_beta = grad_beta.sum(0)  # the key blocks' shares
    return grad_q, grad_k, grad_v, grad_g, grad_beta, grad_initial
