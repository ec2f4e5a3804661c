"""Rung 2: the chunkwise-parallel KDA / GDN / GLA, following DESIGN §6 step by step, in log space.

Per chunk of C tokens with state S entering it (one head; G is the in-chunk inclusive cumsum of g, Γ = e^G):

1. G = cumsum(g) within the chunk.
2. A_kk[r, i] = β_r Σ_d k_rd k_id e^{G_rd − G_id}, i < r.
3. UT transform: M = (I + A_kk)^{-1} Diag(β), by forward substitution.
4. W = M (Γ ⊙ K), U = M V  (the WY representation of the chunk's product of transitions).
5. Ṽ = U − W S.
6. A_qk[r, i] = Σ_d q_rd k_id e^{G_rd − G_id}, i ≤ r.
7. O = (Γ ⊙ Q) S + A_qk Ṽ.
8. S ← Diag(Γ_C) S + (K ⊙ e^{G_C − G})ᵀ Ṽ.

Everything but the state passing (5 and 8) is batched over all chunks at once. Every exponent is a
difference of cumulative log-decays, ≤ 0 (or G ≤ 0 itself) or, for a reference factor, at most the checked
span ``SAFE_EXPONENT``, so nothing overflows: e^{−G} alone is never formed.
GDN is KDA with a gate constant over channels; GLA skips the delta steps (Ṽ = V).
"""

from __future__ import annotations

import torch

from k3course.attention.checks import validate

SUB_CHUNK = 8  # smallest block of the UT transform, and block of the pairwise (fallback) decayed scores
SAFE_EXPONENT = 60.0  # e^60 ≈ 1e26: a factor this large times values of order 1 stays far below fp32's 3.4e38


def _pairwise_block(a, b, G, strict: bool) -> torch.Tensor:
    """Σ_d a_rd b_id e^{G_rd − G_id} for every pair in one block, causally masked.

    a, b, G: ``[..., c, K]`` -> ``[..., c, c]``."""
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., c(r), c(i), K]: G_r − G_i, ≤ 0 where i ≤ r
    weights = torch.exp(diff.clamp(max=0.0))  # entries with i > r are masked below; clamping keeps them finite
    scores = (a.unsqueeze(-2) * b.unsqueeze(-3) * weights).sum(-1)
    c = a.shape[-2]
    keep = torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    return scores * keep


def _pairwise_scores(a, b, G, strict: bool, sub: int) -> torch.Tensor:
    """decayed_scores with every exponent ≤ 0: pairs inside a sub-chunk one by one; a later row r against an
    earlier sub-chunk through that sub-chunk's last position p, e^{G_r − G_p} · e^{G_p − G_i}."""
    C = a.shape[-2]
    blocks = []  # one column block [..., C, sub] per sub-chunk
    for start in range(0, C, sub):
        cols = slice(start, start + sub)
        before = a.new_zeros(*a.shape[:-2], start, sub)  # rows above the sub-chunk: causally zero
        diagonal = _pairwise_block(a[..., cols, :], b[..., cols, :], G[..., cols, :], strict)
        ref = G[..., start + sub - 1: start + sub, :]  # [..., 1, K]
        later = a[..., start + sub:, :] * torch.exp(G[..., start + sub:, :] - ref)  # rows after: G_r − G_p ≤ 0
        earlier = b[..., cols, :] * torch.exp(ref - G[..., cols, :])  # G_p − G_i ≤ 0
        blocks.append(torch.cat([before, diagonal, later @ earlier.transpose(-1, -2)], dim=-2))
    return torch.cat(blocks, dim=-1)


def _causal_mask(C: int, strict: bool, like) -> torch.Tensor:
    """``[C, C]`` lower-triangular 0/1 mask (without the diagonal if strict), multiplied in: cheaper than tril."""
    return torch.ones(C, C, dtype=like.dtype, device=like.device).tril(-1 if strict else 0)


def _referenced_scores(a, b, G, strict: bool, sub: int):
    """decayed_scores as one matrix product per sub-chunk: with p the sub-chunk's first position,
    e^{G_r − G_i} = e^{G_r − G_p} · e^{G_p − G_i}; the first exponent is ≤ 0 for every row from p on (earlier
    rows are causally masked: clamping keeps them finite), the second is at most the sub-chunk's decay span
    (≤ ``SAFE_EXPONENT``), checked by the caller. ``a`` a tensor or a tuple of tensors (one result each)."""
    many = isinstance(a, tuple)
    a = a if many else (a,)
    C = b.shape[-2]
    blocks = [[] for _ in a]  # per tensor in a: one column block [..., C, sub] per sub-chunk
    for start in range(0, C, sub):
        ref = G[..., start:start + 1, :]  # [..., 1, K]
        to_rows = torch.exp(G - ref if start == 0 else (G - ref).clamp(max=0.0))  # factors ≤ 1
        # e^{G_p − G_i} for the sub-chunk's own rows is 1 / to_rows there (unclamped: G_i − G_p ≤ 0); ≤ e^span
        cols = b[..., start:start + sub, :] / to_rows[..., start:start + sub, :]
        for x, x_blocks in zip(a, blocks, strict=True):
            x_blocks.append((x * to_rows) @ cols.transpose(-1, -2))
    mask = _causal_mask(C, strict, G)
    scores = tuple((torch.cat(x_blocks, dim=-1) if len(x_blocks) > 1 else x_blocks[0]) * mask for x_blocks in blocks)
    return scores if many else scores[0]


def _largest_safe_sub_chunk(G) -> int | None:
    """The longest sub-chunk length (the whole chunk C, else 32, 16 or 8, dividing C) whose every sub-chunk
    decays by at most ``SAFE_EXPONENT`` in every channel; None when even 8 tokens decay more (then only
    pairwise is safe)."""
    C = G.shape[-2]
    for sub in (C, 32, 16, 8):
        if sub <= C and C % sub == 0:
            blocks_of_G = G.unflatten(-2, (C // sub, sub))  # [..., C/sub, sub, K]
            if (blocks_of_G[..., 0, :] - blocks_of_G[..., -1, :]).max() <= SAFE_EXPONENT:
                return sub
    return None


def decayed_scores(a, b, G, strict: bool):
    """A[r, i] = Σ_d a_rd b_id e^{G_rd − G_id} for i < r (strict) or i ≤ r, else 0.

    a, b, G: ``[..., C, K]`` (G the inclusive cumulative log-decay) -> ``[..., C, C]``; ``a`` may carry extra
    leading dims, or be a tuple of such tensors (e.g. ``(k, q)``): then one result each, sharing the decay
    factors. Never forms e^{−G}. When the whole chunk, or sub-chunks of 32, 16 or 8 tokens, each decay by at
    most ``SAFE_EXPONENT`` (8 always do under K3's bound g ≥ −5), each sub-chunk's column block is one matrix
    product referenced to its first position; otherwise (e.g. Kimi Linear's unbounded gate at extreme values)
    pairs inside 8-token sub-chunks are formed one by one so that every exponent is ≤ 0.
    """
    sub = _largest_safe_sub_chunk(G)
    if sub is not None:
        return _referenced_scores(a, b, G, strict, sub)
    C = b.shape[-2]
    sub = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    if isinstance(a, tuple):
        return tuple(_pairwise_scores(x, b, G, strict, sub) for x in a)
    return _pairwise_scores(a, b, G, strict, sub)


def _unit_lower_inverse(A) -> torch.Tensor:
    """(I + A)^{-1} for strictly lower A ``[..., c, c]``, by forward substitution.

    Up to ``SUB_CHUNK`` rows (or c odd), row by row: X_r = e_r − Σ_{i<r} A_ri X_i. Larger, in two block rows:
    X_1 = (I + A_11)^{-1} and X_2 = (I + A_22)^{-1} (both diagonal blocks at once, the same way), then the
    second block row's substitution X_21 = −X_2 A_21 X_1, so X = [[X_1, 0], [X_21, X_2]].
    """
    c = A.shape[-1]
    if c > SUB_CHUNK and c % 2 == 0:
        h = c // 2
        X_1, X_2 = _unit_lower_inverse(torch.stack([A[..., :h, :h], A[..., h:, h:]]))
        X_21 = -(X_2 @ A[..., h:, :h] @ X_1)
        return torch.cat([torch.cat([X_1, torch.zeros_like(X_1)], dim=-1), torch.cat([X_21, X_2], dim=-1)], dim=-2)
    eye = torch.eye(c, dtype=A.dtype, device=A.device).expand(*A.shape[:-2], c, c)
    rows = [eye[..., :1, :]]  # row r of X, each [..., 1, c]
    for r in range(1, c):
        rows.append(eye[..., r:r + 1, :] - A[..., r:r + 1, :r] @ torch.cat(rows, dim=-2))
    return torch.cat(rows, dim=-2)


def ut_transform(A_kk, beta) -> torch.Tensor:
    """M = (I + A_kk)^{-1} Diag(β) by forward substitution. A_kk ``[..., C, C]`` strictly lower, beta ``[..., C]``.

    Blockwise, to keep the loop short (see :func:`_unit_lower_inverse`): halves, quarters, … down to 8×8
    diagonal blocks, all blocks of one size at once, each solved row by row."""
    return _unit_lower_inverse(A_kk) * beta.unsqueeze(-2)


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
    """Steps 5 and 8, the only loop over chunks. Substituting step 5 into step 8 makes each chunk an affine map
    of the state, S ← A S + B, with A = Diag(Γ_C) − K̃ᵀW and B = K̃ᵀU (K̃ = K ⊙ e^{G_C − G}); A and B do not
    depend on the state, so they are computed for all chunks at once and the loop is one product per chunk.
    Ṽ = U − W S is then batched over all chunks from the states that entered them.

    W (None for GLA: no delta correction, Ṽ = U = V, A = Diag(Γ_C)), U ``[..., N, C, ·]``; k, G
    ``[..., N, C, K]``; state ``[..., K, V]``. Returns the states entering each chunk ``[..., N, K, V]``,
    Ṽ ``[..., N, C, V]`` and the final state ``[..., K, V]``."""
    leading = state.shape[:-2]
    as_batch = (lambda x: None if x is None else x.reshape(-1, *x.shape[-3:]))  # [L, N, ·, ·]
    decay_to_end = as_batch(G[..., -1:, :].exp().mT)  # Γ_C, [L, N, K, 1]
    k_to_end = as_batch((k * torch.exp(G[..., -1:, :] - G)).mT)  # K̃ᵀ, [L, N, K, C]
    W, U, state = as_batch(W), as_batch(U), state.reshape(-1, *state.shape[-2:])
    increment = k_to_end @ U  # B = K̃ᵀU, [L, N, K, V]
    if W is not None:
        transition = torch.diag_embed(decay_to_end.squeeze(-1)) - k_to_end @ W  # A, [L, N, K, K]
    entering = []
    for n in range(U.shape[1]):
        entering.append(state)
        if W is None:
            state = torch.addcmul(increment[:, n], decay_to_end[:, n], state)  # Diag(Γ_C) S + B
        else:
            state = torch.baddbmm(increment[:, n], transition[:, n], state)  # A S + B
    entering = torch.stack(entering, dim=1)  # [L, N, K, V]
    corrected = U if W is None else U - W @ entering  # Ṽ, [L, N, C, V]
    return (entering.reshape(*leading, *entering.shape[1:]), corrected.reshape(*leading, *corrected.shape[1:]),
            state.reshape(*leading, *state.shape[1:]))


def _chunk_core(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size):
    """Chunkwise KDA (beta given) or GLA (beta None) on validated inputs, g ``[B, T, H, K]``.

    All chunks of all heads are one batch ``[B·H·N, C, ·]``; only steps 5 and 8 loop over chunks."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    dtype, (batch, time, heads, key_dim), value_dim = q.dtype, q.shape, v.shape[-1]
    # padded tokens (k = 0, β = 0, g = 0) leave the state unchanged
    q, k, v, g = (_to_chunks(x.float(), chunk_size) for x in (q, k, v, g))  # [B·H·N, C, ·]
    q = q * scale
    G = g.cumsum(-2)  # step 1, inclusive
    decay = G.exp()  # Γ = e^G ≤ 1
    if beta is None:  # GLA: no delta steps, Ṽ = V
        W, U, A_qk = None, v, decayed_scores(q, k, G, strict=False)
    else:
        beta = _to_chunks(beta.float(), chunk_size)  # [B·H·N, C]
        A_kk, A_qk = decayed_scores((k, q), k, G, strict=False)  # steps 2 and 6 share their decays
        A_kk = A_kk * _causal_mask(chunk_size, True, A_kk) * beta.unsqueeze(-1)  # step 2 (strictly lower)
        M = ut_transform(A_kk, beta)  # step 3
        W, U = M @ (decay * k), M @ v  # step 4
    state = q.new_zeros(batch * heads, key_dim, value_dim)
    if initial_state is not None:
        state = state + initial_state.float().reshape(batch * heads, key_dim, value_dim)
    per_head = (lambda x: None if x is None else x.unflatten(0, (batch * heads, -1)))  # [B·H, N, ...]
    entering, v_new, state = _pass_states(per_head(W), per_head(U), per_head(k), per_head(G), state)  # 5, 8
    o = torch.baddbmm(A_qk @ v_new.flatten(0, 1), decay * q, entering.flatten(0, 1))  # step 7
    o = o.reshape(batch, heads, -1, value_dim).transpose(1, 2)[:, :time]
    final = state.reshape(batch, heads, key_dim, value_dim) if output_final_state else None
    return o.to(dtype), final


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64, *,
              allow_neg_eigval=False):
    """Chunkwise Kimi Delta Attention; same result as :func:`~k3course.attention.recurrent.kda_recurrent`.

    q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]`` (log-decay, ≤ 0); beta ``[B, T, H]``;
    any T (padded internally to a multiple of ``chunk_size``); differentiable. Returns ``o [B, T, H, V]`` in
    the input dtype and the final state ``[B, H, K, V]`` in float32 (or None).
    """
    scale = validate(q, k, v, g, beta, gate="channel", scale=scale, initial_state=initial_state,
                     allow_neg_eigval=allow_neg_eigval)
    return _chunk_core(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)


def gdn_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64, *,
              allow_neg_eigval=False):
    """Chunkwise Gated DeltaNet, g ``[B, T, H]``: KDA with the head's decay repeated over the K channels."""
    scale = validate(q, k, v, g, beta, gate="scalar", scale=scale, initial_state=initial_state,
                     allow_neg_eigval=allow_neg_eigval)
    g = g.unsqueeze(-1).expand(*g.shape, q.shape[-1])
    return _chunk_core(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)


def gla_chunk(q, k, v, g, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """Chunkwise decayed linear attention, S_t = Diag(e^{g_t}) S_{t-1} + k_t v_tᵀ, with g ``[B, T, H]``
    (scalar decay) or ``[B, T, H, K]`` (GLA). Same result as :func:`~k3course.attention.recurrent.gla_recurrent`."""
    gate = "scalar" if isinstance(g, torch.Tensor) and g.dim() == 3 else "channel"
    scale = validate(q, k, v, g, gate=gate, scale=scale, initial_state=initial_state)
    if gate == "scalar":
        g = g.unsqueeze(-1).expand(*g.shape, q.shape[-1])
    return _chunk_core(q, k, v, g, None, scale, initial_state, output_final_state, chunk_size)
