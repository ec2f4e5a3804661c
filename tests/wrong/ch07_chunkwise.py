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
    return torch.linalg.inv(torch.eye(A_kk.shape[-1]) + A_kk)


def ut_sign_flipped(A_kk, beta):
    """(I − A)^{-1} Diag(β)."""
    return torch.linalg.inv(torch.eye(A_kk.shape[-1]) - A_kk) * beta.unsqueeze(-2)


def chunk_step_exclusive_cumsum(q, k, v, g, beta, state):
    """Exclusive cumulative decay G_r = Σ_{s<r} g_s: each token misses its own decay."""
    from k3course.attention.chunk import kda_chunk_step

    shifted = torch.cat([torch.zeros_like(g[..., :1, :]), g[..., :-1, :]], dim=-2)
    o, _ = kda_chunk_step(q, k, v, shifted, beta, state)
    _, new_state = kda_chunk_step(q, k, v, g, beta, state)
    return o, new_state


def chunk_step_no_state_correction(q, k, v, g, beta, state):
    """Uses U instead of Ṽ = U − W S: the delta correction ignores the state entering the chunk."""
    from k3course.attention.chunk import decayed_scores, ut_transform

    G = g.cumsum(-2)
    M = ut_transform(decayed_scores(k, k, G, True) * beta.unsqueeze(-1), beta)
    U = M @ v
    o = (G.exp() * q) @ state + decayed_scores(q, k, G, False) @ U
    k_end = k * torch.exp(G[..., -1:, :] - G)
    return o, G[..., -1, :].exp().unsqueeze(-1) * state + k_end.transpose(-1, -2) @ U


WRONG = {
    "07.decayed_scores": [scores_exponent_flipped, scores_mask_off_by_one],
    "07.ut_transform": [ut_without_beta, ut_sign_flipped],
    "07.kda_chunk_step": [chunk_step_exclusive_cumsum, chunk_step_no_state_correction],
}
