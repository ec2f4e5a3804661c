"""Kimi Delta Attention, chunkwise, as Triton kernels (lesson 07's chunkwise algorithm, lesson 08).

The forward pass is five kernels, one per step of the chunkwise algorithm, each reading and writing global
memory with plain pointer arithmetic (no block pointers):

1. ``_chunk_cumsum_kernel``  G = in-chunk inclusive cumulative sum of the log-decay g (resets every chunk).
2. ``_intra_chunk_kernel``   A_kk[r,i] = β_r Σ_d k_rd k_id e^{G_rd − G_id} (i < r) and
                             A_qk[r,i] = scale Σ_d q_rd k_id e^{G_rd − G_id} (i ≤ r), in ``SUB_CHUNK``-token
                             sub-chunk tiles (16, the smallest tl.dot on a GPU) so that no exponent is ever
                             positive (log-space stability).
3. ``_wy_kernel``            UT transform: X = (I + A_kk)^-1 by forward substitution; W = X (β Γ ⊙ K), U = X (β V).
4. ``_state_kernel``         the only sequential part: for each chunk, store the entering state S, then
                             Ṽ = U − W S and S ← Diag(Γ_C) S + (K ⊙ e^{G_C − G})ᵀ Ṽ.
5. ``_output_kernel``        O = (scale Γ ⊙ Q) S + A_qk Ṽ, all chunks in parallel.

The backward reruns the first four of these kernels (everything but the output) and then its own two (the
reverse state pass, then every chunk's gradients in parallel): :mod:`k3course.kernels.kda_chunk_backward`.

Everything accumulates in fp32 whatever the input dtype; the output has the dtype of ``v``. With bf16 data the
intermediates passed between kernels (A_qk, W, U, Ṽ, the chunk states) are stored in bf16, G and A_kk in fp32.
Under the Triton interpreter (no GPU) inputs must be fp32 (the interpreter computes bf16 wrongly).
"""

from __future__ import annotations

from k3course.kernels import select_triton_mode

TRITON_MODE = select_triton_mode()  # first, before triton is imported (see k3course.kernels)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.autograd.function import once_differentiable  # noqa: E402

from k3course import debug  # noqa: E402
from k3course.kernels.chunk_tiles import block_width, dot_fp32, low_precision, tile_offsets, unit_lower_inverse  # noqa: E402
from k3course.kernels.kda_chunk_backward import kda_chunk_backward  # noqa: E402
from k3course.ops.checks import check_kda_chunk_size, check_lower_bound  # noqa: E402
from k3course.ops.chunk import SUB_CHUNK  # noqa: E402  (the ops sit below the kernels: no cycle)

STATE_KERNEL_STAGES = 2  # software-pipelining depth of the state kernel: 3 needs 249 KB of shared memory in fp32


@triton.jit
def _chunk_cumsum_kernel(g_ptr, out_ptr, T, H, K, BT: tl.constexpr, BK: tl.constexpr):
    """One program per (chunk, batch·head): out[t] = Σ_{s in chunk, s ≤ t} g[s], in fp32."""
    chunk, bh = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # int64 offsets: (b·T + t)·H·K passes 2^31 at K3 size (T = 1M, H = 96, K = 128)
    b, h = bh // H, bh % H
    rows = chunk * BT + tl.arange(0, BT)  # [BT] time indices of this chunk
    offsets, mask = tile_offsets(b, h, T, H, rows, tl.arange(0, BK), K)  # [BT, BK] of the [B, T, H, K] layout
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, tl.cumsum(g, axis=0), mask=mask)


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """In-chunk cumulative log-decay G[b, t, h] = Σ_{s = c·C}^{t} g[b, s, h] with c = ⌊t / C⌋, in fp32.

    g: [B, T, H, K] log-decay (≤ 0). Returns fp32 [B, T, H, K]; the sum restarts at every chunk boundary.
    """
    if g.dim() != 4:
        raise ValueError(f"g must be [B, T, H, K], got shape {tuple(g.shape)}")
    check_kda_chunk_size(chunk_size)
    g = g.contiguous()
    B, T, H, K = g.shape
    out = torch.empty(B, T, H, K, dtype=torch.float32, device=g.device)
    grid = (triton.cdiv(T, chunk_size), B * H)
    _chunk_cumsum_kernel[grid](g, out, T, H, K, BT=chunk_size, BK=block_width(K))
    return out


@triton.jit
def _intra_chunk_kernel(q_ptr, k_ptr, gc_ptr, beta_ptr, akk_ptr, aqk_ptr, scale, T, H, K,
                        BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """One program per (chunk, batch·head): the [BT, BT] matrices A_kk (β-scaled) and A_qk (scaled).

    Tile (a, b) covers rows of sub-chunk a and columns of sub-chunk b ≤ a. Below the diagonal the tile is one
    tl.dot after normalising at the first row n of sub-chunk a: k_r e^{G_r − G_n} and k_i e^{G_n − G_i} both
    have exponents ≤ 0 because G decreases along time. On the diagonal each column is a masked row-sum, so
    the exponent G_r − G_i is only ever taken for i ≤ r.
    """
    chunk, bh = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # int64 offsets: (b·T + t)·H·K passes 2^31 at K3 size (T = 1M, H = 96, K = 128)
    b, h = bh // H, bh % H
    NC: tl.constexpr = BT // BC
    t0 = chunk * BT
    cols = tl.arange(0, BK)
    local = tl.arange(0, BC)
    for a in tl.static_range(NC):
        rows_a = t0 + a * BC + local  # [BC]
        offs_a, mask_a = tile_offsets(b, h, T, H, rows_a, cols, K)
        q_a = tl.load(q_ptr + offs_a, mask=mask_a, other=0.0).to(tl.float32)
        k_a = tl.load(k_ptr + offs_a, mask=mask_a, other=0.0).to(tl.float32)
        g_a = tl.load(gc_ptr + offs_a, mask=mask_a, other=0.0)
        beta_a = tl.load(beta_ptr + (b * T + rows_a) * H + h, mask=rows_a < T, other=0.0).to(tl.float32)
        ref_row = t0 + a * BC
        g_ref = tl.load(gc_ptr + ((b * T + ref_row) * H + h) * K + cols, mask=(cols < K) & (ref_row < T), other=0.0)
        decay_a = tl.exp(tl.where(mask_a, g_a - g_ref[None, :], float("-inf")))  # [BC, BK], entries ≤ 1
        for c in tl.static_range(a):
            rows_c = t0 + c * BC + local
            offs_c, mask_c = tile_offsets(b, h, T, H, rows_c, cols, K)
            k_c = tl.load(k_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
            g_c = tl.load(gc_ptr + offs_c, mask=mask_c, other=0.0)
            exponent = tl.where(mask_c & (ref_row < T), g_ref[None, :] - g_c, float("-inf"))  # ≤ 0
            k_c_decayed = k_c * tl.exp(exponent)
            akk = tl.dot(k_a * decay_a, tl.trans(k_c_decayed), input_precision="ieee") * beta_a[:, None]
            aqk = tl.dot(q_a * decay_a, tl.trans(k_c_decayed), input_precision="ieee") * scale
            _store_tile(akk_ptr, akk, b, h, T, H, rows_a, c * BC + local, BT)
            _store_tile(aqk_ptr, aqk, b, h, T, H, rows_a, c * BC + local, BT)
        akk = tl.zeros([BC, BC], dtype=tl.float32)
        aqk = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(BC):  # a runtime loop: unrolling 16 columns × NC sub-chunks only slows compilation
            row_j = t0 + a * BC + j
            mask_j = (cols < K) & (row_j < T)
            k_j = tl.load(k_ptr + ((b * T + row_j) * H + h) * K + cols, mask=mask_j, other=0.0).to(tl.float32)
            g_j = tl.load(gc_ptr + ((b * T + row_j) * H + h) * K + cols, mask=mask_j, other=0.0)
            at_or_below = local[:, None] >= j  # [BC, 1]: rows r ≥ j, where G_r − G_j ≤ 0
            decay = tl.exp(tl.where(at_or_below & mask_a, g_a - g_j[None, :], float("-inf")))  # [BC, BK]
            kk_col = tl.sum(k_a * k_j[None, :] * decay, axis=1)  # [BC]
            qk_col = tl.sum(q_a * k_j[None, :] * decay, axis=1)
            is_col = local[None, :] == j
            akk = tl.where(is_col & (local[:, None] > j), kk_col[:, None], akk)
            aqk = tl.where(is_col, qk_col[:, None], aqk)
        _store_tile(akk_ptr, akk * beta_a[:, None], b, h, T, H, rows_a, a * BC + local, BT)
        _store_tile(aqk_ptr, aqk * scale, b, h, T, H, rows_a, a * BC + local, BT)


@triton.jit
def _store_tile(ptr, tile, b, h, T, H, rows, cols, BT: tl.constexpr):
    """Store a tile of a [B, T, H, BT] matrix: row = time index, column = position inside the chunk."""
    offsets, mask = tile_offsets(b, h, T, H, rows, cols, BT)
    tl.store(ptr + offsets, tile.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wy_kernel(k_ptr, v_ptr, gc_ptr, beta_ptr, akk_ptr, w_ptr, u_ptr, T, H, K, V,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """One program per (chunk, batch·head): X = (I + A_kk)^-1 (by forward substitution, see
    :func:`~k3course.kernels.chunk_tiles.unit_lower_inverse`), W = X (β e^G ⊙ K), U = X (β V)."""
    chunk, bh = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # int64 offsets: (b·T + t)·H·K passes 2^31 at K3 size (T = 1M, H = 96, K = 128)
    b, h = bh // H, bh % H
    rows = chunk * BT + tl.arange(0, BT)
    inverse = unit_lower_inverse(akk_ptr, b, h, T, H, chunk, BT)
    beta = tl.load(beta_ptr + (b * T + rows) * H + h, mask=rows < T, other=0.0).to(tl.float32)
    k_offsets, mask_k = tile_offsets(b, h, T, H, rows, tl.arange(0, BK), K)
    k = tl.load(k_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
    gc = tl.load(gc_ptr + k_offsets, mask=mask_k, other=0.0)
    w = dot_fp32(inverse, k * tl.exp(gc) * beta[:, None], LOW_PRECISION)
    tl.store(w_ptr + k_offsets, w.to(w_ptr.dtype.element_ty), mask=mask_k)
    for v0 in range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_offsets, mask_v = tile_offsets(b, h, T, H, rows, cols_v, V)
        v = tl.load(v_ptr + v_offsets, mask=mask_v, other=0.0).to(tl.float32)
        u = dot_fp32(inverse, v * beta[:, None], LOW_PRECISION)
        tl.store(u_ptr + v_offsets, u.to(u_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _state_kernel(k_ptr, gc_ptr, w_ptr, u_ptr, h_ptr, vnew_ptr, h0_ptr, ht_ptr, T, H, K, V, NT,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """One program per (value block, batch·head), walking the chunks in order (the sequential part).

    For chunk c with entering state S [K, BV]: store S in h[b, c, h], then Ṽ = U − W S (stored), then
    S ← Diag(e^{G_last}) S + (K ⊙ e^{G_last − G})ᵀ Ṽ, with G_last the cumulative decay at the chunk's last row.
    """
    v_block, bh = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # int64 offsets: (b·T + t)·H·K passes 2^31 at K3 size (T = 1M, H = 96, K = 128)
    b, h = bh // H, bh % H
    cols_k = tl.arange(0, BK)
    cols_v = v_block * BV + tl.arange(0, BV)
    state_offsets = cols_k[:, None] * V + cols_v[None, :]  # [BK, BV] inside one [K, V] state
    state_mask = (cols_k[:, None] < K) & (cols_v[None, :] < V)
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        state += tl.load(h0_ptr + bh * K * V + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    for chunk in range(NT):
        tl.store(h_ptr + ((b * NT + chunk) * H + h) * K * V + state_offsets, state.to(h_ptr.dtype.element_ty),
                 mask=state_mask)
        rows = chunk * BT + tl.arange(0, BT)
        k_offsets, mask_k = tile_offsets(b, h, T, H, rows, cols_k, K)
        v_offsets, mask_v = tile_offsets(b, h, T, H, rows, cols_v, V)
        w = tl.load(w_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + v_offsets, mask=mask_v, other=0.0).to(tl.float32)
        v_new = u - dot_fp32(w, state, LOW_PRECISION)  # [BT, BV]
        tl.store(vnew_ptr + v_offsets, v_new.to(vnew_ptr.dtype.element_ty), mask=mask_v)
        last = tl.minimum(chunk * BT + BT, T) - 1
        g_last = tl.load(gc_ptr + ((b * T + last) * H + h) * K + cols_k, mask=cols_k < K, other=0.0)  # [BK]
        k = tl.load(k_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
        gc = tl.load(gc_ptr + k_offsets, mask=mask_k, other=0.0)
        k_decayed = k * tl.exp(tl.where(mask_k, g_last[None, :] - gc, float("-inf")))  # [BT, BK], exponents ≤ 0
        state = state * tl.exp(g_last)[:, None] + dot_fp32(tl.trans(k_decayed), v_new, LOW_PRECISION)
    if STORE_FINAL_STATE:
        tl.store(ht_ptr + bh * K * V + state_offsets, state, mask=state_mask)


@triton.jit
def _output_kernel(q_ptr, gc_ptr, h_ptr, vnew_ptr, aqk_ptr, o_ptr, scale, T, H, K, V, NT,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """One program per (value block, chunk, batch·head): O = (scale e^G ⊙ Q) S + A_qk Ṽ."""
    v_block, chunk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = bh.to(tl.int64)  # int64 offsets: (b·T + t)·H·K passes 2^31 at K3 size (T = 1M, H = 96, K = 128)
    b, h = bh // H, bh % H
    rows = chunk * BT + tl.arange(0, BT)
    cols_k = tl.arange(0, BK)
    cols_v = v_block * BV + tl.arange(0, BV)
    k_offsets, mask_k = tile_offsets(b, h, T, H, rows, cols_k, K)
    v_offsets, mask_v = tile_offsets(b, h, T, H, rows, cols_v, V)
    q = tl.load(q_ptr + k_offsets, mask=mask_k, other=0.0).to(tl.float32)
    gc = tl.load(gc_ptr + k_offsets, mask=mask_k, other=0.0)
    state_offsets = ((b * NT + chunk) * H + h) * K * V + cols_k[:, None] * V + cols_v[None, :]
    state = tl.load(h_ptr + state_offsets, mask=(cols_k[:, None] < K) & (cols_v[None, :] < V),
                    other=0.0).to(tl.float32)
    local = tl.arange(0, BT)
    aqk_offsets, aqk_mask = tile_offsets(b, h, T, H, rows, local, BT)
    aqk = tl.load(aqk_ptr + aqk_offsets, mask=aqk_mask, other=0.0).to(tl.float32)
    v_new = tl.load(vnew_ptr + v_offsets, mask=mask_v, other=0.0).to(tl.float32)
    # fp32 before the product: inside a torch.compile graph a Python float `scale` arrives as an fp64 scalar
    scaled_q = (q * tl.exp(gc) * scale).to(tl.float32)
    out = dot_fp32(scaled_q, state, LOW_PRECISION) + dot_fp32(aqk, v_new, LOW_PRECISION)
    tl.store(o_ptr + v_offsets, out.to(o_ptr.dtype.element_ty), mask=mask_v)


def _check_inputs(q, k, v, g, beta, initial_state) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    for name, x in (("k", k), ("g", g)):
        if tuple(x.shape) != (B, T, H, K):
            raise ValueError(f"{name} must have the shape of q {(B, T, H, K)}, got {tuple(x.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got shape {tuple(v.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got shape {tuple(beta.shape)}")
    if K > 256:
        raise ValueError(f"q: head dim K must be ≤ 256 for these kernels, got {K}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}, "
                         f"got shape {tuple(initial_state.shape)}")
    devices = {x.device for x in (q, k, v, g, beta)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, g, beta must be on one device, got {sorted(map(str, devices))}")
    if TRITON_MODE == "interpreter" and q.dtype != torch.float32:
        raise TypeError(f"q: the Triton interpreter needs fp32 inputs (bf16 is wrong there), got {q.dtype}")
    if debug.enabled():
        _check_values(q, k, v, g, beta)


def _check_values(q, k, v, g, beta) -> None:
    """The checks that read values back to the host (run under :mod:`k3course.debug` only): finite, g ≤ 0."""
    finite = torch.stack([torch.isfinite(x).all() for x in (q, k, v, g, beta)])  # one host sync for all checks
    positive_g = (g > 0).any()
    if not bool(finite.all()):
        names = [name for name, ok in zip(("q", "k", "v", "g", "beta"), finite.tolist()) if not ok]
        raise ValueError(f"{', '.join(names)} contain(s) NaN or inf")
    if positive_g:
        raise ValueError("g must be a log-decay (≤ 0 everywhere); got positive entries")


def _blocks(K: int, V: int) -> tuple[int, int]:
    return block_width(K), min(64, block_width(V))


def intra_chunk_scores(q, k, gc, beta, scale: float, chunk_size: int = 64):
    """Steps 2 and 6: A_kk [B, T, H, C] (β_r-scaled, strictly lower) and A_qk [B, T, H, C] (scaled, lower).

    Row t holds the scores of token t against the C positions of its own chunk. q, k: [B, T, H, K];
    gc: in-chunk cumulative log-decay (:func:`chunk_local_cumsum`); beta: [B, T, H]. A_kk is fp32 (it is
    inverted next); A_qk has the intermediate dtype (:func:`_intermediate_dtype`).
    """
    B, T, H, K = q.shape
    akk = torch.zeros(B, T, H, chunk_size, dtype=torch.float32, device=q.device)
    aqk = torch.zeros(B, T, H, chunk_size, dtype=_intermediate_dtype(q), device=q.device)
    grid = (triton.cdiv(T, chunk_size), B * H)
    _intra_chunk_kernel[grid](q, k, gc, beta, akk, aqk, scale, T, H, K, BT=chunk_size,
                              BC=min(SUB_CHUNK, chunk_size), BK=block_width(K))
    return akk, aqk


def wy_factors(k, v, gc, beta, akk, chunk_size: int = 64):
    """Steps 3 and 4: with X = (I + A_kk)^-1 per chunk, W = X (β e^G ⊙ K) [B, T, H, K] and U = X (β V) [B, T, H, V]."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    BK, BV = _blocks(K, V)
    stored = dict(dtype=_intermediate_dtype(k), device=k.device)
    w, u = torch.empty(B, T, H, K, **stored), torch.empty(B, T, H, V, **stored)
    _wy_kernel[(triton.cdiv(T, chunk_size), B * H)](k, v, gc, beta, akk, w, u, T, H, K, V, BT=chunk_size, BK=BK,
                                                    BV=BV, LOW_PRECISION=low_precision(k))
    return w, u


def pass_states(k, gc, w, u, initial_state=None, output_final_state=False, chunk_size: int = 64):
    """Steps 5 and 8, sequential over chunks: the state entering each chunk [B, NT, H, K, V], Ṽ = U − W S
    [B, T, H, V] (both in W's dtype) and the final state [B, H, K, V] in fp32 (or None)."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    BK, BV = block_width(K), min(32, block_width(V))  # narrow value blocks: this kernel's only parallelism is B·H·V/BV
    NT = triton.cdiv(T, chunk_size)
    stored = dict(dtype=w.dtype, device=k.device)
    states, v_new = torch.empty(B, NT, H, K, V, **stored), torch.empty(B, T, H, V, **stored)
    final_state = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device) if output_final_state else None
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
    _state_kernel[(triton.cdiv(V, BV), B * H)](
        k, gc, w, u, states, v_new, h0, final_state, T, H, K, V, NT, BT=chunk_size, BK=BK, BV=BV,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state, LOW_PRECISION=low_precision(k),
        num_stages=STATE_KERNEL_STAGES)
    return states, v_new, final_state


def chunk_outputs(q, gc, states, v_new, aqk, scale: float, out_dtype: torch.dtype, chunk_size: int = 64):
    """Step 7, all chunks in parallel: O = (scale e^G ⊙ Q) S + A_qk Ṽ, [B, T, H, V] in ``out_dtype``."""
    B, T, H, K = q.shape
    V = v_new.shape[-1]
    BK, BV = _blocks(K, V)
    NT = states.shape[1]
    o = torch.empty(B, T, H, V, dtype=out_dtype, device=q.device)
    _output_kernel[(triton.cdiv(V, BV), NT, B * H)](q, gc, states, v_new, aqk, o, scale, T, H, K, V, NT,
                                                    BT=chunk_size, BK=BK, BV=BV, LOW_PRECISION=low_precision(q))
    return o


def _intermediate_dtype(x: torch.Tensor) -> torch.dtype:
    """What A_qk, W, U, Ṽ and the chunk states are stored in between kernels: bf16 for bf16 / fp16 data (half
    the memory traffic, as fla does), fp32 otherwise. G, A_kk and the final state are always fp32."""
    return torch.bfloat16 if low_precision(x) else torch.float32


def kda_chunk_forward(q, k, v, g, beta, scale: float, initial_state=None, output_final_state=False,
                      chunk_size: int = 64):
    """The five forward kernels in order, no autograd. Same contract as :func:`kda_chunk_triton`."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    gc = chunk_local_cumsum(g, chunk_size)  # step 1
    akk, aqk = intra_chunk_scores(q, k, gc, beta, scale, chunk_size)  # steps 2 and 6
    w, u = wy_factors(k, v, gc, beta, akk, chunk_size)  # steps 3 and 4
    states, v_new, final_state = pass_states(k, gc, w, u, initial_state, output_final_state, chunk_size)  # 5, 8
    o = chunk_outputs(q, gc, states, v_new, aqk, scale, v.dtype, chunk_size)  # step 7
    return o, final_state


def intra_chunk_factors(q, k, v, g, beta, scale: float, chunk_size: int = 64):
    """The forward's chunk-parallel part, steps 1–4 and 6, as chapter 08's first KDA exercise groups it: G (the
    in-chunk cumulative g), A_qk (scaled), W and U, each fp32 whatever the inputs' dtype. Returns (gc [B, T, H, K],
    aqk [B, T, H, C], w [B, T, H, K], u [B, T, H, V])."""
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    gc = chunk_local_cumsum(g, chunk_size)
    akk, aqk = intra_chunk_scores(q, k, gc, beta, scale, chunk_size)
    w, u = wy_factors(k, v, gc, beta, akk, chunk_size)
    return gc, aqk, w, u


def state_pass(k, gc, w, u, initial_state, chunk_size: int = 64):
    """Steps 5 and 8 (``_state_kernel``), the second exercise's grouping: fp32 (the state entering each chunk
    [B, NT, H, K, V], Ṽ [B, T, H, V], the final state [B, H, K, V]); ``initial_state`` None is a zero state."""
    k, gc, w, u = (x.float().contiguous() for x in (k, gc, w, u))
    return pass_states(k, gc, w, u, initial_state, True, chunk_size)


def output_from_states(q, gc, states, v_new, aqk, scale: float):
    """Step 7 (``_output_kernel``), the third exercise: O = (scale e^G ⊙ Q) S + A_qk Ṽ in fp32 [B, T, H, V]; the
    chunk size is A_qk's last dimension."""
    q, gc, states, v_new, aqk = (x.float().contiguous() for x in (q, gc, states, v_new, aqk))
    return chunk_outputs(q, gc, states, v_new, aqk, scale, torch.float32, aqk.shape[-1])


def kda_chunk_from_kernels(intra_chunk=intra_chunk_factors, pass_state=state_pass, output=output_from_states):
    """Chunkwise KDA's forward from three functions with the contracts of :func:`intra_chunk_factors`,
    :func:`state_pass` and :func:`output_from_states` (a learner's three kernels): a function with the contract
    of ``k3course.ops.kda_chunk`` (forward only, no autograd) that the model runs as its ``kda_chunk`` part."""

    def kda_chunk_composed(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           chunk_size: int = 64, *, lower_bound=None, allow_neg_eigval: bool = False):
        _check_inputs(q, k, v, g, beta, initial_state)
        if allow_neg_eigval:
            raise ValueError("allow_neg_eigval: the chunk kernels take β in [0, 1] only")
        check_kda_chunk_size(chunk_size)
        check_lower_bound(lower_bound, g)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        if lower_bound is not None:
            g = g.clamp(min=lower_bound)
        gc, aqk, w, u = intra_chunk(q, k, v, g, beta, scale, chunk_size)
        states, v_new, final_state = pass_state(k, gc, w, u, initial_state, chunk_size)
        o = output(q, gc, states, v_new, aqk, scale)
        return o.to(v.dtype), final_state if output_final_state else None

    return kda_chunk_composed


class _KDAChunkFunction(torch.autograd.Function):
    """Forward and backward as Triton kernels. The forward keeps only its inputs; the backward recomputes G, A_kk,
    A_qk, W, U, the chunk states and Ṽ with the forward kernels (steps 1–6 and 8, all but the output) and runs the
    backward kernels (:mod:`k3course.kernels.kda_chunk_backward`)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        return kda_chunk_forward(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_o, grad_final_state):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        scale, chunk_size = ctx.scale, ctx.chunk_size
        gc = chunk_local_cumsum(g, chunk_size)  # recomputed, not stored: G, A_kk, A_qk, W, U, S, Ṽ
        akk, aqk = intra_chunk_scores(q, k, gc, beta, scale, chunk_size)
        w, u = wy_factors(k, v, gc, beta, akk, chunk_size)
        states, v_new, _ = pass_states(k, gc, w, u, initial_state, False, chunk_size)
        grads = kda_chunk_backward(q, k, v, gc, beta, akk, aqk, w, states, v_new, grad_o, grad_final_state, scale,
                                   chunk_size, initial_state is not None)
        dq, dk, dv, dg, dbeta, dh0 = (None if grad is None else grad.to(x.dtype)
                                      for grad, x in zip(grads, (q, k, v, g, beta, initial_state)))
        return dq, dk, dv, dg, dbeta, None, dh0, None, None


def kda_chunk_triton(q, k, v, g, beta, scale: float | None = None, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, chunk_size: int = 64, *, lower_bound: float | None = None):
    """Chunkwise KDA with Triton kernels: the recurrence S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ,
    o_t = scale · S_tᵀ q_t, computed chunk by chunk (lesson 07).

    q, k: [B, T, H, K] (K ≤ 256); v: [B, T, H, V]; g: [B, T, H, K] log-decay ≤ 0; beta: [B, T, H];
    initial_state: [B, H, K, V] or None; scale defaults to K^-1/2; chunk_size ∈ {16, 32, 64}; any T ≥ 1.
    ``lower_bound``: as in the torch op ``k3course.ops.kda_chunk``, a number L < 0 with g ≥ L guaranteed (K3's −5);
    g is clamped at L (g ← max(g, L), no gradient below it); the kernels themselves are exact for any g ≤ 0.
    Returns (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] fp32 or None).

    Forward: five Triton kernels (see the module docstring). Backward: the same kernels recompute the chunk
    intermediates, then two backward kernels (:mod:`k3course.kernels.kda_chunk_backward`) give the gradients of
    q, k, v, g, β and the initial state. On a GPU the kernels run natively; on a CPU under the Triton
    interpreter in fp32.
    """
    _check_inputs(q, k, v, g, beta, initial_state)
    check_kda_chunk_size(chunk_size)
    check_lower_bound(lower_bound, g)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if lower_bound is not None:
        g = g.clamp(min=lower_bound)  # what the torch op does: the same forward, and the same zero gradient below L
    return _KDAChunkFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
