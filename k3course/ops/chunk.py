"""Rung 2: the chunkwise-parallel KDA / GDN / GLA, following lesson 07 step by step, in log space.

Per chunk of C tokens with state S entering it (one head; G is the in-chunk inclusive cumsum of g, Γ = e^G):

1. G = cumsum(g) within the chunk.
2. A_kk[r, i] = β_r Σ_d k_rd k_id e^{G_rd − G_id}, i < r.
3. UT transform: M = (I + A_kk)^{-1} Diag(β), by forward substitution.
4. W = M (Γ ⊙ K), U = M V  (the WY representation of the chunk's product of transitions).
5. Ṽ = U − W S.
6. A_qk[r, i] = Σ_d q_rd k_id e^{G_rd − G_id}, i ≤ r.
7. O = (Γ ⊙ Q) S + A_qk Ṽ.
8. S ← Diag(Γ_C) S + (K ⊙ e^{G_C − G})ᵀ Ṽ.

Everything but the state passing (5 and 8) is batched over the chunks of a group (chunks of all heads, see
:func:`_chunk_core`). Every exponent is a
difference of cumulative log-decays, ≤ 0 (or G ≤ 0 itself), so nothing overflows, forward or backward, for any
g ≤ 0: e^{−G} alone is never formed, and no factor is ever divided by another. Exponents are clamped below at
``DECAY_FLOOR`` so that no weight is a subnormal float (slow on CPUs). No value is read back to the host.

A caller that guarantees a lower bound on the gate, g ≥ L (K3's gate is L·σ(·) with L = −5), gets the fast form
of steps 2 and 6 (``lower_bound=L``): within a sub-chunk of S tokens with (S − 1)·|L| ≤ ``FACTOR_RANGE`` (16 for
L = −5, as in fla's kernels and chapter 08's) every decay is referenced to the sub-chunk's first token, so one
batched matrix product per chunk gives all of A_kk and A_qk, and no factor exceeds e^``FACTOR_RANGE``. Without a
bound, blocks of doubling size keep every exponent ≤ 0 (exact for any g ≤ 0, several smaller products).
GDN is KDA with one gate per head shared by the channels; GLA skips the delta steps (Ṽ = V).
"""

from __future__ import annotations

import torch

from k3course.ops.checks import check_lower_bound, float32_recurrence, validate

UT_BLOCK = 8  # the UT transform's smallest diagonal blocks, solved row by row
SUB_CHUNK = 16  # most tokens per sub-chunk, whose decays are referenced to one token: the bounded-gate scores here,
# the intra-chunk tiles of the Triton kernel (fla's 16)
GROUP_SCORES = 64 * 64 * 64  # score entries of the chunks processed together (64 chunks of 64 × 64, or 256 of
# 32 × 32): float32 temporaries of ~1 MB stay in the caches
FACTOR_RANGE = 75.0  # largest exponent of a bounded-gate factor: e^75 ≈ 4e32, so even the masked (discarded) entries,
# sums of 128 such products, stay below float32's largest number, e^88.7
DECAY_FLOOR = -30.0  # decay exponents are raised to this: e^-30 ≈ 9e-14 of the largest weight (1), far below fp32's
# resolution, and it keeps every factor and every product of two factors a normal float (subnormals, e^x for
# x < −87, make exp and matmuls many times slower on x86 CPUs)


def _decay_weight(exponent, like) -> torch.Tensor:
    """e^x for an exponent x ≤ 0 (a difference of cumulative log-decays) in ``like``'s dtype (x may be float64,
    see :func:`_chunk_group`), as e^{max(x, DECAY_FLOOR)}: that changes a weight by less than e^-30."""
    return exponent.to(like.dtype).clamp(min=DECAY_FLOOR).exp_()  # in place on the fresh clamped copy


def _causal_mask(C: int, strict: bool, like) -> torch.Tensor:
    """``[C, C]`` lower-triangular 0/1 mask (without the diagonal if strict), multiplied in: cheaper than tril."""
    return torch.ones(C, C, dtype=like.dtype, device=like.device).tril(-1 if strict else 0)


def _pairwise_block(a, b, G, strict: bool) -> torch.Tensor:
    """Σ_d a_rd b_id e^{G_rd − G_id} for every pair in one block, causally masked, one weight per pair.

    a ``[n, ..., c, K]`` (n stacked left operands), b, G ``[..., c, K]`` -> ``[n, ..., c, c]``."""
    weights = _decay_weight((G.unsqueeze(-2) - G.unsqueeze(-3)).clamp(max=0.0), b)  # [.., c(r), c(i), K]: e^{G_r − G_i}
    scores = (a.unsqueeze(-2) * b.unsqueeze(-3) * weights).sum(-1)
    return scores * _causal_mask(G.shape[-2], strict, scores)


def _off_diagonal_tiles(a, b, G, s: int) -> torch.Tensor:
    """For every block of 2s positions, the tile (rows s..2s) × (columns 0..s) as one matrix product referenced
    to the tile's first row n: e^{G_r − G_i} = e^{G_r − G_n} · e^{G_n − G_i}, both exponents ≤ 0 (r ≥ n > i).

    a ``[n, L, C, K]``, b, G ``[L, C, K]`` -> ``[n, L, C/(2s), s, s]``."""
    n, L, C, K = a.shape
    blocks = C // (2 * s)
    a_later = a.reshape(n, L, blocks, 2, s, K).unbind(3)[1]  # unbind, not indexing: a cheaper backward
    b_earlier = b.reshape(L, blocks, 2, s, K).unbind(2)[0]
    G_earlier, G_later = G.reshape(L, blocks, 2, s, G.shape[-1]).unbind(2)
    ref = G_later[:, :, :1]  # [L, blocks, 1, K]: the tile's first row
    rows = a_later * _decay_weight(G_later - ref, b)  # [n, L, blocks, s, K]
    cols = b_earlier * _decay_weight(ref - G_earlier, b)  # [L, blocks, s, K]
    rows = rows.permute(1, 2, 0, 3, 4).reshape(L * blocks, n * s, K)  # the n operands share one product
    tiles = torch.bmm(rows, cols.reshape(L * blocks, s, K).mT.contiguous())  # [L·blocks, n·s, s]
    return tiles.view(L, blocks, n, s, s).permute(2, 0, 1, 3, 4)


def _block_diagonal(scores, c: int) -> torch.Tensor:
    """The view of ``scores [n, L, C, C]`` holding, for every block of c positions, the c × c diagonal block
    split into halves: ``[n, L, 2, c/2, 2, c/2, C/c]`` (index [.., 1, :, 0, :, :] is the lower-left tile)."""
    n, L, C, _ = scores.shape
    return scores.view(n, L, C // c, 2, c // 2, C // c, 2, c // 2).diagonal(dim1=2, dim2=5)


def _channel_scores(a, b, G, strict: bool) -> torch.Tensor:
    """decayed_scores for a channel gate, exact for any g ≤ 0: every exponent is ≤ 0 and none is e^{−G}.

    Blocks of doubling size: the smallest (C with its factors 2 divided out: 1 for C a power of two) pairwise,
    then for each block of 2s positions its lower-left s × s tile as one batched matrix product referenced to the
    tile's first row (:func:`_off_diagonal_tiles`). a ``[n, L, C, K]``; b, G ``[L, C, K]`` -> ``[n, L, C, C]``."""
    n, L, C, K = a.shape
    leaf = C
    while leaf % 2 == 0:
        leaf //= 2
    scores = a.new_zeros(n, L, C, C)
    if leaf == 1:  # the diagonal: e^0 = 1
        if not strict:
            scores.diagonal(dim1=-2, dim2=-1).copy_((a * b).sum(-1))
    else:
        blocks = C // leaf
        diagonal = _pairwise_block(a.reshape(n, L, blocks, leaf, K), b.reshape(L, blocks, leaf, K),
                                   G.reshape(L, blocks, leaf, K), strict)  # [n, L, blocks, leaf, leaf]
        scores.view(n, L, blocks, leaf, blocks, leaf).diagonal(dim1=2, dim2=4).copy_(diagonal.permute(0, 1, 3, 4, 2))
    s = leaf
    while s < C:
        _block_diagonal(scores, 2 * s)[:, :, 1, :, 0].copy_(_off_diagonal_tiles(a, b, G, s).permute(0, 1, 3, 4, 2))
        s *= 2
    return scores


def _bounded_sub_chunk(lower_bound: float, C: int) -> int:
    """Tokens per sub-chunk of :func:`_bounded_scores`: the largest S ≤ ``SUB_CHUNK`` (halving) with
    (S − 1)·|lower_bound| ≤ ``FACTOR_RANGE``, so that no factor exceeds e^``FACTOR_RANGE``; at most C."""
    size = SUB_CHUNK
    while size > 1 and (size - 1) * -lower_bound > FACTOR_RANGE:
        size //= 2
    return min(size, C)


def _bounded_scores(operands, b, G, strict: bool, S: int) -> list:
    """decayed_scores for a channel gate with every step g ≥ L, in sub-chunks of S tokens, (S − 1)·|L| ≤ 75.

    With p_a the first and e_a the last token of sub-chunk a, the weight of row r (in sub-chunk a) and column i
    (in sub-chunk c ≤ a) is a product of three factors, each formed from one exponent:

        e^{G_r − G_i} = e^{G_r − G_{p_a}} · e^{G_{p_a} − G_{e_c}} · e^{G_{e_c} − G_i}
                        (row, ≤ 1)         (bridge)               (column, ≤ 1)

    For c < a the bridge is ≤ 1 (a difference ≤ 0, floored at ``DECAY_FLOOR``); on the diagonal (c = a) it is
    e^{G_{p_a} − G_{e_a}} ≤ e^{(S − 1)·|L|} ≤ e^75, and the row and column factors are ≥ e^−75: every factor is a
    normal float32. The bridge scales the columns once per row sub-chunk ``[L, NC, C, K]``, so the scores of all
    operands are one batched product, [n·S rows] × [C columns] per sub-chunk of every chunk (the n operands
    stacked). Masked entries (i > r, up to e^75 · a·b) are dropped by ``torch.where``. operands: n tensors
    ``[L, C, K]``; b, G ``[L, C, K]`` -> n tensors ``[L, C, C]``.
    """
    L, C, K = b.shape
    pad = (-C) % S  # pad to whole sub-chunks: zero operands, G constant (g = 0)
    if pad:
        operands = [torch.cat([x, x.new_zeros(L, pad, K)], dim=-2) for x in operands]
        b, G = torch.cat([b, b.new_zeros(L, pad, K)], dim=-2), torch.cat([G, G[:, -1:].expand(L, pad, K)], dim=-2)
    padded = C + pad
    blocks = padded // S
    G = G.view(L, blocks, S, K)
    first, last = G[:, :, :1], G[:, :, -1:]  # G_p, G_e: [L, NC, 1, K]
    row_factor = (G - first).to(b.dtype).exp_()  # e^{G_r − G_p} ∈ [e^-75, 1], [L, NC, S, K]
    columns = b.reshape(L, blocks, S, K) * (last - G).to(b.dtype).exp_()  # b_i e^{G_e − G_i}
    bridge = (first[:, :, None, 0] - last[:, None, :, 0]).to(b.dtype)  # G_{p_a} − G_{e_c}: [L, NC(a), NC(c), K]
    # for c > a the exponent is positive (up to 320): capped at FACTOR_RANGE, then multiplied by 0
    bridge = bridge.clamp(DECAY_FLOOR, FACTOR_RANGE).exp_() * _causal_mask(blocks, False, bridge).unsqueeze(-1)
    columns = (columns.unsqueeze(1) * bridge.unsqueeze(-2)).view(L * blocks, padded, K).mT  # per row sub-chunk a
    n = len(operands)
    rows = torch.stack([x.reshape(L, blocks, S, K) for x in operands], dim=2)  # [L, NC, n, S, K]
    rows = rows * row_factor.unsqueeze(2)  # a_r e^{G_r − G_p}
    products = torch.bmm(rows.view(L * blocks, n * S, K), columns).view(L, blocks, n, S, padded)  # one product
    keep = _causal_mask(padded, strict, b).bool().view(blocks, S, padded)
    return [torch.where(keep, products[:, :, i], 0.0).view(L, padded, padded)[:, :C, :C] for i in range(n)]


def _scalar_scores(a, b, G, strict: bool) -> torch.Tensor:
    """decayed_scores for a gate shared by the K channels (G ``[L, C, 1]``): (a bᵀ) ⊙ e^{G_r − G_i}, the decay one
    ``[C, C]`` matrix, exact for any g ≤ 0. a ``[n, L, C, K]``, b ``[L, C, K]`` -> ``[n, L, C, C]``."""
    n, L, C, K = a.shape
    products = torch.bmm(a.transpose(0, 1).reshape(L, n * C, K), b.mT)  # [L, n·C, C], the n operands at once
    weights = _decay_weight((G - G.mT).clamp(max=0.0), b) * _causal_mask(C, strict, b)  # [L, C, C]; masked: 1 * 0
    return products.view(L, n, C, C).transpose(0, 1) * weights


def decayed_scores(a, b, G, strict: bool, lower_bound: float | None = None):
    """A[r, i] = Σ_d a_rd b_id e^{G_rd − G_id} for i < r (strict) or i ≤ r, else 0.

    a, b ``[..., C, K]``, G ``[..., C, K]`` (the inclusive cumulative log-decay of a channel gate) or
    ``[..., C, 1]`` (a gate shared by the channels, as in GDN) -> ``[..., C, C]``; leading dims broadcast. ``a``
    may be a tuple of tensors (e.g. ``(k, q)``): then one result each, sharing the decay factors. Exact for every
    g ≤ 0 up to weights below e^``DECAY_FLOOR``: e^{−G} alone, which overflows, is never formed, and the products
    are batched. ``lower_bound`` L: the caller guarantees every step of G is ≥ L; then a channel gate takes the
    fast form, one product per chunk (:func:`_bounded_scores`), else blocks of doubling size
    (:func:`_channel_scores`); a shared gate needs one ``[C, C]`` weight matrix (:func:`_scalar_scores`).
    """
    many = isinstance(a, tuple)
    operands = a if many else (a,)
    C, K = b.shape[-2:]
    lead = torch.broadcast_shapes(*(x.shape[:-2] for x in operands), b.shape[:-2], G.shape[:-2])
    flat = lambda x: x.expand(*lead, *x.shape[-2:]).reshape(-1, *x.shape[-2:])  # [L, C, ·]
    operands, b, G = [flat(x) for x in operands], flat(b), flat(G)
    if G.shape[-1] == 1:
        scores = _scalar_scores(torch.stack(operands), b, G, strict)
    elif lower_bound is None:
        scores = _channel_scores(torch.stack(operands), b, G, strict)
    else:
        scores = _bounded_scores(operands, b, G, strict, _bounded_sub_chunk(lower_bound, C))
    scores = [x.reshape(*lead, C, C) for x in scores]
    return tuple(scores) if many else scores[0]


def _unit_lower_inverse(A) -> torch.Tensor:
    """(I + A)^{-1} for strictly lower A ``[..., c, c]``, by forward substitution (no autograd: see
    :class:`_UnitLowerInverse`).

    Up to ``UT_BLOCK`` rows (or c odd), row by row in place: X_r = e_r − Σ_{i<r} A_ri X_i. Larger, in two block
    rows: X_1 = (I + A_11)^{-1} and X_2 = (I + A_22)^{-1} (both diagonal blocks at once, the same way), then the
    second block row's substitution X_21 = −X_2 A_21 X_1, so X = [[X_1, 0], [X_21, X_2]].
    """
    c = A.shape[-1]
    if c > UT_BLOCK and c % 2 == 0:
        h = c // 2
        X_1, X_2 = _unit_lower_inverse(torch.stack([A[..., :h, :h], A[..., h:, h:]]))
        X = A.new_zeros(A.shape)
        X[..., :h, :h], X[..., h:, h:] = X_1, X_2
        X[..., h:, :h] = -(X_2 @ A[..., h:, :h] @ X_1)
        return X
    X = torch.eye(c, dtype=A.dtype, device=A.device).expand(A.shape).clone()
    for r in range(1, c):  # row r from the rows above it (X is lower triangular: only its first r columns)
        X[..., r:r + 1, :r] -= A[..., r:r + 1, :r] @ X[..., :r, :r]
    return X


class _UnitLowerInverse(torch.autograd.Function):
    """X = (I + A)^{-1} for strictly lower A ``[..., c, c]``: forward by substitution (:func:`_unit_lower_inverse`),
    backward in closed form. From dX = −X dA X: ∂L/∂A = −Xᵀ (∂L/∂X) Xᵀ, kept on the strictly lower entries (the
    only ones the forward reads): two batched products, where autograd through the substitution would replay
    its many small ops in reverse."""

    @staticmethod
    def forward(ctx, A):
        X = _unit_lower_inverse(A)
        ctx.save_for_backward(X)
        return X

    @staticmethod
    def backward(ctx, grad_X):
        (X,) = ctx.saved_tensors
        return -(X.mT @ grad_X @ X.mT) * _causal_mask(X.shape[-1], True, X)


def ut_transform(A_kk, beta) -> torch.Tensor:
    """M = (I + A_kk)^{-1} Diag(β) by forward substitution. A_kk ``[..., C, C]`` strictly lower, beta ``[..., C]``.

    Blockwise, to keep the loop short (see :func:`_unit_lower_inverse`): halves, quarters, … down to
    ``UT_BLOCK`` × ``UT_BLOCK`` diagonal blocks, all blocks of one size at once, each solved row by row. Its
    gradient is the closed form of :class:`_UnitLowerInverse`."""
    return _UnitLowerInverse.apply(A_kk) * beta.unsqueeze(-2)


def kda_chunk_step(q, k, v, g, beta, state):
    """One chunk of KDA, steps 1–8 above, for a single chunk (q already scaled).

    q, k, g: ``[..., C, K]``; v ``[..., C, V]``; beta ``[..., C]``; state ``[..., K, V]``.
    Returns ``(o [..., C, V], new_state [..., K, V])``: the same as C steps of the recurrence.
    """
    G = g.cumsum(-2)
    A_kk = decayed_scores(k, k, G, strict=True) * beta.unsqueeze(-1)
    M = ut_transform(A_kk, beta)
    W, U = M @ (G.exp() * k), M @ v
    v_new = U - W @ state
    o = (G.exp() * q) @ state + decayed_scores(q, k, G, strict=False) @ v_new
    k_to_end = k * torch.exp(G[..., -1:, :] - G)
    return o, G[..., -1, :].exp().unsqueeze(-1) * state + k_to_end.transpose(-1, -2) @ v_new


def factored_scores(q, k, G) -> torch.Tensor:
    """The naive factored form (Q ⊙ e^G)(K ⊙ e^{−G})ᵀ, causally masked: equal to A_qk in exact arithmetic,
    but e^{−G} overflows float32 once −G > 88 (a chunk of 64 tokens at g = −5 reaches 320). For the lesson."""
    scores = (q * G.exp()) @ (k * torch.exp(-G)).transpose(-1, -2)
    C = q.shape[-2]
    return scores * torch.ones(C, C, dtype=torch.bool, device=q.device).tril()


def _to_chunks(x, chunk_size: int) -> torch.Tensor:
    """``[B, T, H, ...]`` -> ``[B·H·N, C, ...]``, contiguous (T padded with zeros to a multiple of C)."""
    batch, time, heads = x.shape[:3]
    pad = (-time) % chunk_size
    if pad:
        x = torch.cat([x, x.new_zeros(batch, pad, *x.shape[2:])], dim=1)
    x = x.reshape(batch, -1, chunk_size, heads, *x.shape[3:]).movedim(3, 1)  # [B, H, N, C, ...]
    return x.reshape(-1, chunk_size, *x.shape[4:])


def _pass_states(W, U, k, G, state):
    """Steps 5 and 8, the only loop over chunks: per chunk, Ṽ = U − W S (GLA: Ṽ = U), then
    S ← Diag(Γ_C) S + K̃ᵀṼ with K̃ = K ⊙ e^{G_C − G}. Everything that does not depend on the state (K̃ᵀ, Γ_C) is
    formed for all chunks at once; the loop is two products per chunk, batched over the heads.

    W (None for GLA: no delta correction), U ``[..., N, C, ·]``; k ``[..., N, C, K]``; G ``[..., N, C, K]`` or
    ``[..., N, C, 1]`` (a gate shared by the channels); state ``[..., K, V]``. Returns the states entering each
    chunk ``[..., N, K, V]``, Ṽ ``[..., N, C, V]`` and the final state ``[..., K, V]``."""
    leading = state.shape[:-2]
    as_batch = (lambda x: None if x is None else x.reshape(-1, *x.shape[-3:]))  # [L, N, ·, ·]
    decay_to_end = as_batch(_decay_weight(G[..., -1:, :], k).mT)  # Γ_C, [L, N, K, 1] (or [L, N, 1, 1])
    k_to_end = as_batch((k * _decay_weight(G[..., -1:, :] - G, k)).mT)  # K̃ᵀ, [L, N, K, C]
    W, U, state = as_batch(W), as_batch(U), state.reshape(-1, *state.shape[-2:])
    entering, corrected = [], []
    for n, (chunk_decay, chunk_keys) in enumerate(zip(decay_to_end.unbind(1), k_to_end.unbind(1))):
        entering.append(state)
        v_new = U[:, n] if W is None else torch.baddbmm(U[:, n], W[:, n], state, alpha=-1.0)  # Ṽ = U − W S
        corrected.append(v_new)
        state = torch.baddbmm(chunk_decay * state, chunk_keys, v_new)  # Diag(Γ_C) S + K̃ᵀṼ
    entering, corrected = torch.stack(entering, dim=1), torch.stack(corrected, dim=1)  # [L, N, K, V], [L, N, C, V]
    return (entering.reshape(*leading, *entering.shape[1:]), corrected.reshape(*leading, *corrected.shape[1:]),
            state.reshape(*leading, *state.shape[1:]))


def _chunk_group(q, k, v, g, beta, state, scale, lower_bound):
    """Steps 1–8 for a group of consecutive chunks of every head, q, k, g ``[B·H, n, C, K]``, v
    ``[B·H, n, C, V]``, beta ``[B·H, n, C]`` (None for GLA), state ``[B·H, K, V]`` entering the group's first
    chunk. Returns ``(o [B·H, n, C, V], state leaving the group)``. The query scale is applied to the output of
    step 7 (o is linear in q); g is clamped at ``lower_bound`` when one is given.

    G is summed in float64 (then only exponents are formed from it): a chunk of 64 tokens at g = −5 reaches
    G = −320, where a float32 cumulative sum is off by ~3e-5, and every weight e^{G_r − G_i} would inherit that
    relative error."""
    heads, n, C = q.shape[:3]
    chunks = lambda x: None if x is None else x.flatten(0, 1)  # [B·H·n, C, ·]: every chunk one batch entry
    per_head = lambda x: None if x is None else x.unflatten(0, (heads, n))  # [B·H, n, C, ·]
    if lower_bound is not None:
        g = g.clamp(min=lower_bound)  # the guarantee, enforced: a step below L would overflow a factor
    G = g.double().cumsum(-2)  # step 1, inclusive; float64 (see above)
    q, k, v, G, beta = (chunks(x) for x in (q, k, v, G, beta))
    decay = _decay_weight(G, q)  # Γ = e^G ≤ 1
    if beta is None:  # GLA: no delta steps, Ṽ = V
        W, U, A_qk = None, v, decayed_scores(q, k, G, strict=False, lower_bound=lower_bound)
    else:
        A_kk, A_qk = decayed_scores((k, q), k, G, strict=False, lower_bound=lower_bound)  # steps 2 and 6 share
        A_kk = A_kk * _causal_mask(C, True, A_kk) * beta.unsqueeze(-1)  # step 2 (strictly lower)
        M = ut_transform(A_kk, beta)  # step 3
        W, U = M @ (decay * k), M @ v  # step 4
    entering, v_new, state = _pass_states(per_head(W), per_head(U), per_head(k), per_head(G), state)  # 5, 8
    o = torch.baddbmm(A_qk @ v_new.flatten(0, 1), decay * q, entering.flatten(0, 1), beta=scale, alpha=scale)  # 7
    return per_head(o), state


def _chunk_core(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, lower_bound=None):
    """Chunkwise KDA (beta given) or GLA (beta None) on validated inputs, g ``[B, T, H, K]`` (channel gate) or
    ``[B, T, H, 1]`` (one gate per head, broadcast over the K channels: GDN and scalar-decay attention).

    The tokens are taken in groups of consecutive chunks (``GROUP_SCORES`` / C² chunks of all heads together),
    the state passed from group to group as from chunk to chunk: a group is cut into chunks ``[B·H, n, C, ·]``
    when its turn comes, every step but the state passing (5, 8) is batched over its chunks
    (:func:`_chunk_group`), and its output is written back in the token layout, so that a group's temporaries
    stay in the CPU's caches and the time grows linearly with T. ``lower_bound`` L (a channel gate known to be
    ≥ L): g is clamped at L, and steps 2 and 6 take the fast form (:func:`decayed_scores`)."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    with float32_recurrence(q.device):  # under autocast too
        dtype, (batch, time, heads, key_dim), value_dim = q.dtype, q.shape, v.shape[-1]
        wide = torch.promote_types(dtype, torch.float32)  # the precision of the computation and of the state
        state = q.new_zeros(batch * heads, key_dim, value_dim, dtype=wide)
        if initial_state is not None:
            state = state + initial_state.to(wide).reshape(batch * heads, key_dim, value_dim)
        chunks_per_group = max(1, GROUP_SCORES // chunk_size**2)
        tokens = chunk_size * max(1, chunks_per_group // (batch * heads))  # tokens of each head per group
        # padded tokens (k = 0, β = 0, g = 0) leave the state unchanged
        cut = lambda x, start: None if x is None else (  # [B·H, n, C, ·]
            _to_chunks(x[:, start:start + tokens], chunk_size).to(wide).unflatten(0, (batch * heads, -1)))
        outputs = []
        for start in range(0, time, tokens):
            o, state = _chunk_group(*(cut(x, start) for x in (q, k, v, g, beta)), state, scale, lower_bound)
            outputs.append(o.unflatten(0, (batch, heads)).movedim(1, 3).flatten(1, 2))  # [B, n·C, H, V], a view
        o = torch.cat(outputs, dim=1)[:, :time] if time else q.new_zeros(batch, 0, heads, value_dim)
        final = state.reshape(batch, heads, key_dim, value_dim) if output_final_state else None
        return o.to(dtype), final


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64, *,
              allow_neg_eigval=False, lower_bound=None):
    """Chunkwise Kimi Delta Attention; same result as :func:`~k3course.ops.recurrent.kda_recurrent`.

    q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]`` (log-decay, ≤ 0); beta ``[B, T, H]``;
    any T (padded internally to a multiple of ``chunk_size``); differentiable. ``lower_bound``: a number L < 0
    with g ≥ L guaranteed (K3's bounded gate: −5), for the fast intra-chunk form; g is clamped at L. Returns
    ``o [B, T, H, V]`` in the input dtype and the final state ``[B, H, K, V]`` in float32, float64 for float64
    inputs (or None).
    """
    scale = validate(q, k, v, g, beta, gate="channel", scale=scale, initial_state=initial_state,
                     allow_neg_eigval=allow_neg_eigval)
    check_lower_bound(lower_bound, g)
    return _chunk_core(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, lower_bound)


def gdn_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64, *,
              allow_neg_eigval=False):
    """Chunkwise Gated DeltaNet, g ``[B, T, H]``: KDA with the head's decay shared by the K channels (its decayed
    scores need one ``[C, C]`` weight matrix, not one per channel)."""
    scale = validate(q, k, v, g, beta, gate="scalar", scale=scale, initial_state=initial_state,
                     allow_neg_eigval=allow_neg_eigval)
    return _chunk_core(q, k, v, g.unsqueeze(-1), beta, scale, initial_state, output_final_state, chunk_size)


def gla_chunk(q, k, v, g, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """Chunkwise decayed linear attention, S_t = Diag(e^{g_t}) S_{t-1} + k_t v_tᵀ, with g ``[B, T, H]``
    (scalar decay) or ``[B, T, H, K]`` (GLA). Same result as :func:`~k3course.ops.recurrent.gla_recurrent`."""
    gate = "scalar" if isinstance(g, torch.Tensor) and g.dim() == 3 else "channel"
    scale = validate(q, k, v, g, gate=gate, scale=scale, initial_state=initial_state)
    if gate == "scalar":
        g = g.unsqueeze(-1)
    return _chunk_core(q, k, v, g, None, scale, initial_state, output_final_state, chunk_size)
