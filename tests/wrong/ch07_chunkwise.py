"""Plausible wrong answers for chapter 07."""

import torch


def scores_exponent_flipped(a, b, G, strict):
    """e^{G_i − G_r}: the decay runs backwards (and blows up)."""
    w = torch.exp(G.unsqueeze(-3) - G.unsqueeze(-2))
    C = a.shape[-2]
    return (a.unsqueeze(-2) * b.unsqueeze(-3) * w).sum(-1) * torch.ones(C, C).tril(-1 if strict else 0)


def scores_mask_off_by_one(a, b, G, strict):
    """Always keeps the diagonal (i ≤ r), even for A_kk."""
    w = torch.exp((G.unsqueeze(-2) - G.unsqueeze(-3)).clamp(max=0))
    C = a.shape[-2]
    return (a.unsqueeze(-2) * b.unsqueeze(-3) * w).sum(-1) * torch.ones(C, C).tril()


def _forward_substitution(A_kk):
    """X = (I + A)^{-1} row by row, as the exercise asks (the right inverse: the wrong answers differ elsewhere)."""
    C = A_kk.shape[-1]
    eye = torch.eye(C, dtype=A_kk.dtype).expand(*A_kk.shape[:-2], C, C)
    rows = [eye[..., 0, :]]
    for r in range(1, C):
        rows.append(eye[..., r, :] - (A_kk[..., r, :r].unsqueeze(-1) * torch.stack(rows, dim=-2)).sum(-2))
    return torch.stack(rows, dim=-2)


def ut_without_beta(A_kk, beta):
    """(I + A)^{-1}, forgetting Diag(β)."""
    return _forward_substitution(A_kk)


def ut_sign_flipped(A_kk, beta):
    """(I − A)^{-1} Diag(β)."""
    return _forward_substitution(-A_kk) * beta.unsqueeze(-2)


def ut_the_package_own(A_kk, beta):
    """The package's own ut_transform, reached through k3course.ops's re-export."""
    from k3course import ops

    return ops.ut_transform(A_kk, beta)


def _chunk_step(q, k, v, beta, state, G, A_kk=None, W=None):
    """Steps 2–8 of one chunk from a given G, with optional wrong A_kk or W (the right ones when None)."""
    from k3course.ops.chunk import decayed_scores, ut_transform

    A_kk = decayed_scores(k, k, G, True) * beta.unsqueeze(-1) if A_kk is None else A_kk
    M = ut_transform(A_kk, beta)
    W = M @ (G.exp() * k) if W is None else W(M)
    v_new = M @ v - W @ state
    o = (G.exp() * q) @ state + decayed_scores(q, k, G, False) @ v_new
    k_end = k * torch.exp(G[..., -1:, :] - G)
    return o, G[..., -1, :].exp().unsqueeze(-1) * state + k_end.transpose(-1, -2) @ v_new


def chunk_step_exclusive_cumsum(q, k, v, g, beta, state):
    """Exclusive cumulative decay G_r = Σ_{s<r} g_s: each token misses its own decay."""
    return _chunk_step(q, k, v, beta, state, g.cumsum(-2) - g)


def chunk_step_no_state_correction(q, k, v, g, beta, state):
    """Uses U instead of Ṽ = U − W S: the delta correction ignores the state entering the chunk."""
    return _chunk_step(q, k, v, beta, state, g.cumsum(-2), W=lambda M: torch.zeros(*M.shape[:-1], k.shape[-1]))


def chunk_step_w_undecayed(q, k, v, g, beta, state):
    """W = M K instead of M (e^G ⊙ K): the state's correction misses the decay up to each token."""
    return _chunk_step(q, k, v, beta, state, g.cumsum(-2), W=lambda M: M @ k)


def chunk_step_beta_off_akk_rows(q, k, v, g, beta, state):
    """A_kk = strict scores without Diag(β) on its rows (β only in M's columns)."""
    from k3course.ops.chunk import decayed_scores

    G = g.cumsum(-2)
    return _chunk_step(q, k, v, beta, state, G, A_kk=decayed_scores(k, k, G, True))


def chunk_step_the_package_own(q, k, v, g, beta, state):
    """The package's own kda_chunk_step."""
    from k3course.ops.chunk import kda_chunk_step

    return kda_chunk_step(q, k, v, g, beta, state)


def chunk_step_through_the_public_kda_chunk(q, k, v, g, beta, state):
    """The package's batched kda_chunk on one chunk (heads as the batch): the package's answer by another road."""
    from k3course.ops import kda_chunk

    C = q.shape[-2]
    lead = q.shape[:-2]
    as_sequence = [x.reshape(-1, C, x.shape[-1]).unsqueeze(2) for x in (q, k, v, g)]
    o, final = kda_chunk(*as_sequence, beta.reshape(-1, C, 1), scale=1.0, chunk_size=C,
                         initial_state=state.reshape(-1, 1, *state.shape[-2:]), output_final_state=True)
    return o.squeeze(2).reshape(*lead, C, -1), final.squeeze(1).reshape(state.shape)


def scores_masked_with_where(a, b, G, strict):
    """e^{G_r − G_i} without the clamp, the entries above the diagonal selected away by torch.where: the forward is
    right, but at g = −5 over 64 tokens those exponents overflow and the backward sends inf · 0 = NaN."""
    C = a.shape[-2]
    scores = (a.unsqueeze(-2) * b.unsqueeze(-3) * torch.exp(G.unsqueeze(-2) - G.unsqueeze(-3))).sum(-1)
    keep = torch.ones(C, C, dtype=torch.bool).tril(-1 if strict else 0)
    return torch.where(keep, scores, torch.zeros((), dtype=scores.dtype))


def scores_the_package_own(a, b, G, strict):
    """The package's own decayed_scores."""
    import k3course.ops.chunk

    return k3course.ops.chunk.decayed_scores(a, b, G, strict)


def scores_factored(a, b, G, strict):
    """(a ⊙ e^G)(b ⊙ e^{−G})ᵀ: exact in theory; e^{−G} overflows fp32 once −G > 88 (18 tokens at g = −5)."""
    C = a.shape[-2]
    return ((a * G.exp()) @ (b * torch.exp(-G)).transpose(-1, -2)) * torch.ones(C, C).tril(-1 if strict else 0)


def ut_with_a_solver(A_kk, beta):
    """The right M, by a triangular solve (the exercise asks for forward substitution)."""
    eye = torch.eye(A_kk.shape[-1], dtype=A_kk.dtype).expand_as(A_kk)
    return torch.linalg.solve_triangular(eye + A_kk, eye, upper=False, unitriangular=True) * beta.unsqueeze(-2)


def ut_neumann_series(A_kk, beta):
    """(I + A)^{-1} ≈ I − A + A² − A³: four terms, exact only if A⁴ = 0 (chunks of up to 4 tokens)."""
    eye = torch.eye(A_kk.shape[-1], dtype=A_kk.dtype)
    square = A_kk @ A_kk
    return (eye - A_kk + square - square @ A_kk) * beta.unsqueeze(-2)


def ut_in_float32(A_kk, beta):
    """Forward substitution in float32 whatever the input dtype."""
    return _forward_substitution(A_kk.float()) * beta.float().unsqueeze(-2)


def chunk_step_factored_scores(q, k, v, g, beta, state):
    """A_qk as (Q ⊙ e^G)(K ⊙ e^{−G})ᵀ: NaN at strong decay over a 64-token chunk."""
    from k3course.ops.chunk import decayed_scores, ut_transform

    G = g.cumsum(-2)
    C = q.shape[-2]
    M = ut_transform(decayed_scores(k, k, G, True) * beta.unsqueeze(-1), beta)
    v_new = M @ v - (M @ (G.exp() * k)) @ state
    a_qk = ((q * G.exp()) @ (k * torch.exp(-G)).transpose(-1, -2)) * torch.ones(C, C).tril()
    o = (G.exp() * q) @ state + a_qk @ v_new
    k_end = k * torch.exp(G[..., -1:, :] - G)
    return o, G[..., -1, :].exp().unsqueeze(-1) * state + k_end.transpose(-1, -2) @ v_new


WRONG = {
    "07.decayed_scores": [scores_exponent_flipped, scores_mask_off_by_one, scores_factored, scores_masked_with_where,
                          scores_the_package_own],
    "07.ut_transform": [ut_without_beta, ut_sign_flipped, ut_with_a_solver, ut_neumann_series, ut_in_float32,
                        ut_the_package_own],
    "07.kda_chunk_step": [chunk_step_exclusive_cumsum, chunk_step_no_state_correction, chunk_step_factored_scores,
                          chunk_step_w_undecayed, chunk_step_beta_off_akk_rows, chunk_step_the_package_own,
                          chunk_step_through_the_public_kda_chunk],
}

# What the check's message says, for the wrong answers the grader knows the step of (tests/test_grading.py).
POINTED = {
    scores_masked_with_where: "your gradient with respect to a is NaN at",
    scores_exponent_flipped: "wrong with a weak decay: check the factor e^{G_rd − G_id}",
    scores_mask_off_by_one: "wrong with no decay and strict=True: strict=True leaves the diagonal out",
    scores_the_package_own: "called the package's own k3course.ops.chunk.decayed_scores",
    ut_without_beta: "wrong already with A = 0",
    ut_sign_flipped: "wrong with β = 1: check the forward substitution",
    ut_the_package_own: "called the package's own k3course.ops.chunk.ut_transform",
    chunk_step_exclusive_cumsum: "wrong with β = 0 (S only decays): check G = cumsum(g), inclusive",
    chunk_step_no_state_correction: "wrong with an incoming state and g = 0: check how the state enters",
    chunk_step_w_undecayed: "wrong with an incoming state and a decay: check where the decay meets the state: "
                            "W = M(e^G ⊙ K)",
    chunk_step_beta_off_akk_rows: "wrong with β < 1, g = 0 and S = 0: β scales A_kk's rows",
    chunk_step_factored_scores: "wrong at the strongest decay over 64 tokens: every exponent a difference",
    chunk_step_the_package_own: "called the package's own k3course.ops.chunk.kda_chunk_step",
    chunk_step_through_the_public_kda_chunk: "called the package's own k3course.ops.chunk.kda_chunk",
}
