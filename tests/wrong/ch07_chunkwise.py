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


def ut_without_beta(A_kk, beta):
    """(I + A)^{-1}, forgetting Diag(β)."""
    from k3course.ops.chunk import ut_transform

    return ut_transform(A_kk, torch.ones_like(beta))


def ut_sign_flipped(A_kk, beta):
    """(I − A)^{-1} Diag(β)."""
    from k3course.ops.chunk import ut_transform

    return ut_transform(-A_kk, beta)


def chunk_step_exclusive_cumsum(q, k, v, g, beta, state):
    """Exclusive cumulative decay G_r = Σ_{s<r} g_s: each token misses its own decay."""
    from k3course.ops.chunk import kda_chunk_step

    shifted = torch.cat([torch.zeros_like(g[..., :1, :]), g[..., :-1, :]], dim=-2)
    o, _ = kda_chunk_step(q, k, v, shifted, beta, state)
    _, new_state = kda_chunk_step(q, k, v, g, beta, state)
    return o, new_state


def chunk_step_no_state_correction(q, k, v, g, beta, state):
    """Uses U instead of Ṽ = U − W S: the delta correction ignores the state entering the chunk."""
    from k3course.ops.chunk import decayed_scores, ut_transform

    G = g.cumsum(-2)
    M = ut_transform(decayed_scores(k, k, G, True) * beta.unsqueeze(-1), beta)
    U = M @ v
    o = (G.exp() * q) @ state + decayed_scores(q, k, G, False) @ U
    k_end = k * torch.exp(G[..., -1:, :] - G)
    return o, G[..., -1, :].exp().unsqueeze(-1) * state + k_end.transpose(-1, -2) @ U



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
    from k3course.ops.chunk import ut_transform

    return ut_transform(A_kk.float(), beta.float())


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
    "07.decayed_scores": [scores_exponent_flipped, scores_mask_off_by_one, scores_factored],
    "07.ut_transform": [ut_without_beta, ut_sign_flipped, ut_with_a_solver, ut_neumann_series, ut_in_float32],
    "07.kda_chunk_step": [chunk_step_exclusive_cumsum, chunk_step_no_state_correction, chunk_step_factored_scores],
}
