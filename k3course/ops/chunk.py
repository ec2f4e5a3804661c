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
from torch.autograd.function import once_differentiable

from k3course.ops.checks import check_lower_bound, float32_recurrence, validate
from k3course.parts import is_replaced, part

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


def _pad_tokens(x, pad: int) -> torch.Tensor:
    """``x [L, C, ·]`` with ``pad`` zero rows appended along the tokens."""
    return torch.cat([x, x.new_zeros(x.shape[0], pad, x.shape[-1])], dim=-2) if pad else x


def _bounded_factors(b, G, S: int):
    """The factors of :func:`_bounded_scores` for sub-chunks of S tokens (C padded to whole sub-chunks: b zero,
    G constant). b, G ``[L, C, K]`` -> row factor e^{G_r − G_p} and column factor e^{G_e − G_i} ``[L, NC, S, K]``,
    the bridge e^{G_{p_a} − G_{e_c}} ``[L, NC(a), NC(c), K]`` (0 for c > a) and the bridged columns
    b_i e^{G_{e_c} − G_i} e^{G_{p_a} − G_{e_c}} ``[L·NC(a), C, K]`` (one matrix per row sub-chunk a)."""
    L, C, K = b.shape
    pad = (-C) % S
    if pad:
        b, G = _pad_tokens(b, pad), torch.cat([G, G[:, -1:].expand(L, pad, K)], dim=-2)
    blocks = (C + pad) // S
    G = G.view(L, blocks, S, K)
    first, last = G[:, :, :1], G[:, :, -1:]  # G_p, G_e: [L, NC, 1, K]
    row_factor = (G - first).to(b.dtype).exp_()  # e^{G_r − G_p} ∈ [e^-75, 1]
    column_factor = (last - G).to(b.dtype).exp_()  # e^{G_e − G_i} ∈ [e^-75, 1]
    bridge = (first[:, :, None, 0] - last[:, None, :, 0]).to(b.dtype)  # G_{p_a} − G_{e_c}: [L, NC(a), NC(c), K]
    # for c > a the exponent is positive (up to 320): capped at FACTOR_RANGE, then multiplied by 0
    bridge = bridge.clamp(DECAY_FLOOR, FACTOR_RANGE).exp_() * _causal_mask(blocks, False, bridge).unsqueeze(-1)
    columns = (b.view(L, blocks, S, K) * column_factor).unsqueeze(1) * bridge.unsqueeze(-2)
    return row_factor, column_factor, bridge, columns.view(L * blocks, C + pad, K)


def _bounded_rows(operands, row_factor) -> list:
    """The operands ``[L, C, K]`` times their row factor e^{G_r − G_p} (``[L, NC, S, K]``), one sub-chunk per
    batch entry: n tensors ``[L·NC, S, K]``, the left sides of the batched products."""
    L, blocks, S, K = row_factor.shape
    row_factor = row_factor.view(L * blocks, S, K)
    return [_pad_tokens(x, blocks * S - x.shape[1]).reshape(L * blocks, S, K) * row_factor for x in operands]


def _bounded_scores(operands, b, G, strict: bool, S: int) -> list:
    """decayed_scores for a channel gate with every step g ≥ L, in sub-chunks of S tokens, (S − 1)·|L| ≤ 75.

    With p_a the first and e_a the last token of sub-chunk a, the weight of row r (in sub-chunk a) and column i
    (in sub-chunk c ≤ a) is a product of three factors, each formed from one exponent:

        e^{G_r − G_i} = e^{G_r − G_{p_a}} · e^{G_{p_a} − G_{e_c}} · e^{G_{e_c} − G_i}
                        (row, ≤ 1)         (bridge)               (column, ≤ 1)

    For c < a the bridge is ≤ 1 (a difference ≤ 0, floored at ``DECAY_FLOOR``); on the diagonal (c = a) it is
    e^{G_{p_a} − G_{e_a}} ≤ e^{(S − 1)·|L|} ≤ e^75, and the row and column factors are ≥ e^−75: every factor is a
    normal float32 (:func:`_bounded_factors`). The bridge scales the columns once per row sub-chunk
    ``[L, NC, C, K]``, so the scores of each operand are one batched product, [S rows] × [C columns] per
    sub-chunk of every chunk (:func:`_bounded_products`). Masked entries (i > r, up to e^75 · a·b) are dropped by
    ``torch.where``. operands: n tensors ``[L, C, K]``; b, G ``[L, C, K]`` -> n tensors ``[L, C, C]``.
    """
    factors = _bounded_factors(b, G, S)
    return _bounded_products(_bounded_rows(operands, factors[0]), factors[3], b.shape[1], (strict,) * len(operands))


def _bounded_products(rows, columns, C: int, strict: tuple) -> list:
    """The scores of :func:`_bounded_scores` from its factors: rows n tensors ``[L·NC, S, K]``
    (:func:`_bounded_rows`), bridged columns ``[L·NC, C, K]`` (:func:`_bounded_factors`); operand j masked
    strictly if ``strict[j]``. Returns n tensors ``[L, C, C]``."""
    padded = columns.shape[1]
    return [torch.where(_causal_mask(padded, s, columns).bool(), torch.bmm(x, columns.mT).view(-1, padded, padded),
                        0.0)[:, :C, :C] for x, s in zip(rows, strict)]


def _bounded_scores_backward(rows, grads, factors) -> tuple:
    """The gradients of :func:`_bounded_scores`' A_j[r, i] = Σ_d a_jrd b_id e^{G_rd − G_id} (j over the
    operands) for upstream gradients dA_j ``[L, C, C]`` that are zero where A_j is masked, through the same
    factors (:func:`_bounded_factors`, :func:`_bounded_rows`), in batched products:

        da_jr = e^{G_r − G_p} Σ_i dA_j[r, i] (bridged column i),
        db_i  = e^{G_e − G_i} Σ_a bridge[a, c] Σ_{j, r ∈ a} dA_j[r, i] a_jr e^{G_r − G_p}.

    The gradient of G follows without them: dG = Σ_j a_j ⊙ da_j − b ⊙ db. An intermediate reaches
    |dA|·|a|·S·e^75, finite for |dA|·|a| up to ~5e4 (loss gradients are far smaller). rows: n tensors
    ``[L·NC, S, K]`` -> (n tensors da_j ``[L, C, K]``, db ``[L, C, K]``)."""
    row_factor, column_factor, bridge, columns = factors
    L, blocks, S, K = row_factor.shape
    C, padded = grads[0].shape[-1], columns.shape[1]
    if padded > C:
        grads = [torch.nn.functional.pad(x, (0, padded - C, 0, padded - C)) for x in grads]
    grads = [x.view(L * blocks, S, padded) for x in grads]  # the rows of each sub-chunk a
    grad_rows = [(torch.bmm(x, columns).view(L, blocks, S, K) * row_factor).view(L, padded, K)[:, :C] for x in grads]
    grad_columns = torch.bmm(grads[0].mT, rows[0])
    for x, rows_x in zip(grads[1:], rows[1:]):
        grad_columns.baddbmm_(x.mT, rows_x)
    grad_columns = grad_columns.view(L, blocks, blocks, S, K)  # [L, NC(a), NC(c), S, K]
    grad_b = grad_columns[:, 0] * bridge[:, 0, :, None]  # Σ_a bridge[a, c] (…), one row sub-chunk at a time
    for a in range(1, blocks):
        grad_b = torch.addcmul(grad_b, grad_columns[:, a], bridge[:, a, :, None])
    return grad_rows, (grad_b * column_factor).view(L, padded, K)[:, :C]


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
    S ← Diag(Γ_C) S + K̃ᵀṼ with K̃ = K ⊙ e^{G_C − G}. Everything that does not depend on the state (K̃, Γ_C) is
    formed for all chunks at once; the loop (:func:`_state_loop`) is two products per chunk, batched over the heads.

    W (None for GLA: no delta correction), U ``[..., N, C, ·]``; k ``[..., N, C, K]``; G ``[..., N, C, K]`` or
    ``[..., N, C, 1]`` (a gate shared by the channels); state ``[..., K, V]``. Returns the states entering each
    chunk ``[..., N, K, V]``, Ṽ ``[..., N, C, V]`` and the final state ``[..., K, V]``."""
    _, k_to_end, decay_to_end = _decays_to_chunk_end(k, G)
    return _state_loop(W, U, k_to_end, decay_to_end, state)


def _decays_to_chunk_end(k, G):
    """What the state passing needs of G, formed for all chunks at once: e^{G_C − G} ``[..., C, K]``, K̃ = K ⊙
    e^{G_C − G} ``[..., C, K]`` and Γ_C = e^{G_C} ``[..., K, 1]`` (``[..., 1, 1]`` for a gate shared by the
    channels). k ``[..., C, K]``, G ``[..., C, K]`` or ``[..., C, 1]``."""
    to_end = _decay_weight(G[..., -1:, :] - G, k)
    return to_end, k * to_end, _decay_weight(G[..., -1:, :], k).mT


def _state_loop(W, U, k_to_end, decay_to_end, state):
    """The loop of :func:`_pass_states`, chunk after chunk: Ṽ = U − W S, S ← Diag(Γ_C) S + K̃ᵀṼ. Shapes as
    there, with K̃ ``[..., N, C, K]`` and Γ_C ``[..., N, K, 1]`` given."""
    leading = state.shape[:-2]
    as_batch = (lambda x: None if x is None else x.reshape(-1, *x.shape[-3:]))  # [L, N, ·, ·]
    W, U, k_to_end, decay_to_end = (as_batch(x) for x in (W, U, k_to_end, decay_to_end))
    state = state.reshape(-1, *state.shape[-2:])
    entering, corrected = [], []
    for n in range(U.shape[1]):
        entering.append(state)
        v_new = U[:, n] if W is None else torch.baddbmm(U[:, n], W[:, n], state, alpha=-1.0)  # Ṽ = U − W S
        corrected.append(v_new)
        state = torch.baddbmm(decay_to_end[:, n] * state, k_to_end[:, n].mT, v_new)  # Diag(Γ_C) S + K̃ᵀṼ
    entering, corrected = torch.stack(entering, dim=1), torch.stack(corrected, dim=1)  # [L, N, K, V], [L, N, C, V]
    return (entering.reshape(*leading, *entering.shape[1:]), corrected.reshape(*leading, *corrected.shape[1:]),
            state.reshape(*leading, *state.shape[1:]))


def _state_loop_backward(grad_v_part, grad_s_part, W, k_to_end, decay_to_end, grad_state):
    """The backward of :func:`_state_loop`, chunks in reverse: with dS' the gradient of the state leaving chunk n,
    dṼ = (dṼ from the outputs) + K̃ dS', and the state entering it gets dS = (dS from the outputs)
    + Diag(Γ_C) dS' − Wᵀ dṼ, which is dS' for chunk n − 1. Two products per chunk, batched over the heads.

    grad_v_part ``[L, N, C, V]``, grad_s_part ``[L, N, K, V]``, W, k_to_end (K̃) ``[L, N, C, K]``, decay_to_end
    (Γ_C) ``[L, N, K, 1]``, grad_state ``[L, K, V]`` (of the final state). Returns dṼ ``[L, N, C, V]``, dS' for
    every chunk ``[L, N, K, V]`` and the gradient of the state entering the first ``[L, K, V]``."""
    chunks = W.shape[1]
    grad_v_new, grad_leaving = [None] * chunks, [None] * chunks
    for n in reversed(range(chunks)):
        grad_leaving[n] = grad_state
        grad_v_new[n] = torch.baddbmm(grad_v_part[:, n], k_to_end[:, n], grad_state)
        grad_state = torch.baddbmm(torch.addcmul(grad_s_part[:, n], decay_to_end[:, n], grad_state),
                                   W[:, n].mT, grad_v_new[n], alpha=-1.0)
    return torch.stack(grad_v_new, dim=1), torch.stack(grad_leaving, dim=1), grad_state


class _BoundedKDAChunks(torch.autograd.Function):
    """Steps 1–8 for a group of chunks (:func:`_chunk_group`) of KDA with a bounded channel gate, with the
    backward written out: autograd through the forward would replay its hundreds of small operations in reverse
    and keep all their temporaries; this backward is a dozen batched products, two per chunk in the reverse loop
    over the chunks, and a few elementwise operations.

    The forward keeps Γ ⊙ Q, Γ ⊙ K, the scores' factors and rows, D = strict_tril(DS(K, K)) (A_kk = Diag(β) D),
    A_qk, X = (I + A_kk)^{-1}, W, Ṽ, K̃ = K ⊙ e^{G_C − G} and the states. The backward, per chunk (s the
    scale, S the state entering, S' leaving, dS' its gradient; M = X Diag(β), R = V − (Γ ⊙ K) S, so Ṽ = M R):

        dṼ = s·A_qkᵀ dO + K̃ dS',   dS = s·(Γ ⊙ Q)ᵀ dO + Diag(Γ_C) dS' − Wᵀ dṼ   (chunks in reverse)
        dA_qk = s·tril(dO Ṽᵀ),  d(Γ ⊙ Q) = s·dO Sᵀ,  dK̃ = Ṽ dS'ᵀ
        Y = Xᵀ dṼ:  dV = dR = Mᵀ dṼ = Diag(β) Y,  d(Γ ⊙ K) = −dR Sᵀ = −Diag(β) Y Sᵀ,
                    dA_kk = −strict_tril(Xᵀ dM Mᵀ) = −strict_tril(Y Ṽᵀ)   (dM = dṼ Rᵀ, M R = Ṽ),
                    dβ_i = Σ_r dM_ri X_ri + Σ_j dA_kk,ij D_ij = Σ_v R_iv Y_iv + Σ_j dA_kk,ij D_ij

    with Σ_v R ⊙ Y = Σ_v V ⊙ Y − Σ_d (Γ ⊙ K) ⊙ (Y Sᵀ); then the scores' gradients with dD = Diag(β) dA_kk
    (:func:`_bounded_scores_backward`), and G's from every place it enters: dG = Q ⊙ dQ + K ⊙ (dK_+ − dK_−) with
    dK = dK_+ + dK_− split into the parts where G enters with a + sign (the scores' rows, Γ ⊙ K) and a − sign (the
    scores' columns, K̃), and at the chunk's last row dG_C = Σ_v S' ⊙ dS' (K̃'s and Γ_C's share,
    Σ_v (Γ_C S + K̃ᵀṼ) ⊙ dS'). dg is dG summed from each row to the chunk's end. Inputs and outputs as
    :func:`_chunk_group`'s (g already clamped); sub_chunk: :func:`_bounded_sub_chunk`."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, scale, sub_chunk):
        heads, n, C = q.shape[:3]
        chunks = lambda x: x.flatten(0, 1)  # [B·H·n, C, ·]: every chunk one batch entry
        per_head = lambda x: x.unflatten(0, (heads, n))
        G = g.double().cumsum(-2)  # step 1, in float64 (see _chunk_group)
        q, k, v, G, beta = (chunks(x) for x in (q, k, v, G, beta))
        decay = _decay_weight(G, q)  # Γ
        decay_q, decay_k = decay * q, decay * k
        factors = _bounded_factors(k, G, sub_chunk)
        rows = _bounded_rows((k, q), factors[0])
        scores_kk, A_qk = _bounded_products(rows, factors[3], C, (True, False))  # steps 2 and 6: D and A_qk
        X = _unit_lower_inverse(scores_kk * beta.unsqueeze(-1))  # step 3
        M = X * beta.unsqueeze(-2)
        W, U = M @ decay_k, M @ v  # step 4
        to_end, k_to_end, decay_to_end = _decays_to_chunk_end(k, G)  # e^{G_C − G}, K̃, Γ_C [L, K, 1]
        entering, v_new, state = _state_loop(*(per_head(x) for x in (W, U, k_to_end, decay_to_end)), state)  # 5, 8
        entering, v_new = chunks(entering), chunks(v_new)
        o = (A_qk @ v_new).baddbmm_(decay_q, entering, beta=scale, alpha=scale)  # step 7
        ctx.save_for_backward(q, k, v, beta, decay, decay_q, decay_k, *factors, *rows, scores_kk, A_qk, X, W,
                              v_new, entering, state, to_end, k_to_end, decay_to_end)
        ctx.scale = scale
        return per_head(o), state

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_o, grad_state):
        with float32_recurrence(grad_o.device):  # a backward called under autocast still computes in float32
            (q, k, v, beta, decay, decay_q, decay_k, *factors, rows_k, rows_q, scores_kk, A_qk, X, W, v_new, entering,
             final, to_end, k_to_end, decay_to_end) = ctx.saved_tensors
            heads, C = final.shape[0], q.shape[1]
            per_head = lambda x: x.unflatten(0, (heads, -1))
            grad_o = grad_o.reshape(v_new.shape) * ctx.scale  # s·dO, [L, C, V]
            grad_v_new, grad_leaving, grad_initial = _state_loop_backward(
                per_head(A_qk.mT @ grad_o), per_head(decay_q.mT @ grad_o), per_head(W), per_head(k_to_end),
                per_head(decay_to_end), grad_state)
            grad_v_new, grad_leaving = grad_v_new.flatten(0, 1), grad_leaving.flatten(0, 1)
            grad_A_qk = (grad_o @ v_new.mT) * _causal_mask(C, False, q)
            Y = X.mT @ grad_v_new
            grad_v = beta.unsqueeze(-1) * Y
            Z = Y @ entering.mT  # Y Sᵀ
            grad_A_kk = (Y @ v_new.mT) * -_causal_mask(C, True, q)
            grad_beta = (v * Y).sum(-1) - (decay_k * Z).sum(-1) + (grad_A_kk * scores_kk).sum(-1)
            (grad_k_rows, grad_q), grad_k_columns = _bounded_scores_backward(
                (rows_k, rows_q), (grad_A_kk * beta.unsqueeze(-1), grad_A_qk), factors)
            grad_q = torch.addcmul(grad_q, decay, grad_o @ entering.mT)  # + Γ ⊙ d(Γ ⊙ Q)
            grad_k_plus = torch.addcmul(grad_k_rows, decay * beta.unsqueeze(-1), Z, value=-1.0)  # + Γ ⊙ d(Γ ⊙ K)
            grad_k_minus = torch.addcmul(grad_k_columns, to_end, v_new @ grad_leaving.mT)  # + e^{G_C − G} ⊙ dK̃
            leaving = torch.cat([per_head(entering)[:, 1:], final.unsqueeze(1)], dim=1).flatten(0, 1)  # S' per chunk
            grad_G = torch.addcmul(q * grad_q, k, grad_k_plus - grad_k_minus)
            reverse_sum = _causal_mask(C, False, q).mT.expand(grad_G.shape[0], C, C)  # dg_t = Σ_{r ≥ t} dG_r + dG_C
            grad_g = torch.baddbmm((leaving * grad_leaving).sum(-1).unsqueeze(-2), reverse_sum, grad_G)
            return (*(per_head(x) for x in (grad_q, grad_k_plus + grad_k_minus, grad_v, grad_g, grad_beta)),
                    grad_initial, None, None)


def _chunk_group(q, k, v, g, beta, state, scale, lower_bound):
    """Steps 1–8 for a group of consecutive chunks of every head, q, k, g ``[B·H, n, C, K]``, v
    ``[B·H, n, C, V]``, beta ``[B·H, n, C]`` (None for GLA), state ``[B·H, K, V]`` entering the group's first
    chunk. Returns ``(o [B·H, n, C, V], state leaving the group)``. The query scale is applied to the output of
    step 7 (o is linear in q); g is clamped at ``lower_bound`` when one is given. KDA with a lower bound (K3's
    path) runs as :class:`_BoundedKDAChunks`, whose backward is written out, when a gradient will be taken and
    the UT transform is the package's (a learner's, held by :func:`k3course.parts.use_parts`, is differentiated by
    autograd like every other path; without a gradient the plain forward below keeps no tensors for it).

    G is summed in float64 (then only exponents are formed from it): a chunk of 64 tokens at g = −5 reaches
    G = −320, where a float32 cumulative sum is off by ~3e-5, and every weight e^{G_r − G_i} would inherit that
    relative error."""
    heads, n, C = q.shape[:3]
    chunks = lambda x: None if x is None else x.flatten(0, 1)  # [B·H·n, C, ·]: every chunk one batch entry
    per_head = lambda x: None if x is None else x.unflatten(0, (heads, n))  # [B·H, n, C, ·]
    if lower_bound is not None:
        g = g.clamp(min=lower_bound)  # the guarantee, enforced: a step below L would overflow a factor
        by_hand = (beta is not None and not is_replaced("ut_transform") and torch.is_grad_enabled()
                   and any(x.requires_grad for x in (q, k, v, g, beta, state)))  # K3's path, trained
        if by_hand:
            return _BoundedKDAChunks.apply(q, k, v, g, beta, state, scale, _bounded_sub_chunk(lower_bound, C))
    G = g.double().cumsum(-2)  # step 1, inclusive; float64 (see above)
    q, k, v, G, beta = (chunks(x) for x in (q, k, v, G, beta))
    decay = _decay_weight(G, q)  # Γ = e^G ≤ 1
    if beta is None:  # GLA: no delta steps, Ṽ = V
        W, U, A_qk = None, v, decayed_scores(q, k, G, strict=False, lower_bound=lower_bound)
    else:
        A_kk, A_qk = decayed_scores((k, q), k, G, strict=False, lower_bound=lower_bound)  # steps 2 and 6 share
        A_kk = A_kk * _causal_mask(C, True, A_kk) * beta.unsqueeze(-1)  # step 2 (strictly lower)
        M = part("ut_transform", ut_transform)(A_kk, beta)  # step 3 (a learner's, while k3course.parts holds one)
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
