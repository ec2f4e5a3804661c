"""Chapter 07 exercises: decayed intra-chunk scores, the UT transform, one whole chunk of KDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3course.grading.registry import Case, Exercise, Forbidden, register
from k3course.ops.chunk import decayed_scores, kda_chunk_step, ut_transform

SOLVERS = Forbidden(frozenset({"inv", "inverse", "inv_ex", "solve", "solve_ex", "solve_triangular",
                               "triangular_solve", "lstsq", "pinv", "cholesky_solve", "lu_solve", "matrix_power"}),
                    "this exercise asks for forward substitution, row by row, without a solver or an inverse")


def _chunk(seed, C, K=4, V=3, g_low=-1.0):
    """One chunk for two heads: q, k ``[2, C, K]``, v ``[2, C, V]``, g ``[2, C, K]``, beta ``[2, C]``, state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, C, K, generator=gen), F.normalize(torch.randn(2, C, K, generator=gen), dim=-1)
    v, g = torch.randn(2, C, V, generator=gen), g_low * torch.rand(2, C, K, generator=gen)
    return q, k, v, g, torch.rand(2, C, generator=gen), torch.randn(2, K, V, generator=gen)


def _scores_cases():
    q, k, _, g, _, _ = _chunk(0, 10)
    _, _, _, strong, _, _ = _chunk(1, 24, g_low=-5.0)
    G, G_strong = g.cumsum(-2), torch.full_like(strong, -5.0).cumsum(-2)
    q24, k24 = torch.randn(2, 24, 4, generator=torch.Generator().manual_seed(2)), _chunk(3, 24)[1]
    q64, k64, _, _, _, _ = _chunk(7, 64)
    G64 = torch.full_like(q64, -5.0).cumsum(-2)
    return [Case("A_qk: i ≤ r", (q, k, G, False)),
            Case("A_kk: i < r", (k, k, G, True)),
            Case("g = -5 over 24 tokens (e^{-G} would overflow)", (q24, k24, G_strong, False)),
            Case("chunk of 64 at the strongest decay g = -5, A_kk", (k64, k64, G64, True)),
            Case("float64 inputs keep their dtype", (q.double(), k.double(), G.double(), False))]


def _ut_cases():
    gen = torch.Generator().manual_seed(4)
    A = 0.4 * torch.randn(2, 10, 10, generator=gen).tril(-1)
    beta = torch.rand(2, 10, generator=gen)
    _, k64, _, g64, beta64, _ = _chunk(8, 64, g_low=-0.2)
    A64 = decayed_scores(k64, k64, g64.cumsum(-2), True) * beta64.unsqueeze(-1)
    return [Case("random strictly lower A, β", (A, beta)),
            Case("β = 1", (A, torch.ones_like(beta))),
            Case("A = 0", (torch.zeros_like(A), beta)),
            Case("a real A_kk of a 64-token chunk", (A64, beta64)),
            Case("float64 inputs keep their dtype", (A.double(), beta.double()))]


def _step_cases():
    q, k, v, g, beta, state = _chunk(5, 12)
    q5, k5, v5, g5, beta5, state5 = _chunk(6, 16)
    q64, k64, v64, g64, beta64, state64 = _chunk(9, 64)
    return [Case("one chunk of 12", (q, k, v, g, beta, state)),
            Case("zero state entering", (q, k, v, g, beta, torch.zeros_like(state))),
            Case("g = -5: strong decay", (q5, k5, v5, torch.full_like(g5, -5.0), beta5, state5)),
            Case("chunk of 64 at the strongest decay g = -5 (e^{-G} overflows)",
                 (q64, k64, v64, torch.full_like(g64, -5.0), beta64, state64)),
            Case("keys not of unit norm", (q, 0.5 * torch.randn(2, 12, 4, generator=torch.Generator().manual_seed(10)),
                                           v, g, beta, state)),
            Case("float64 inputs keep their dtype", tuple(x.double() for x in (q, k, v, g, beta, state)))]


register(Exercise("07.decayed_scores", decayed_scores, _scores_cases))
register(Exercise("07.ut_transform", ut_transform, _ut_cases, forbidden=SOLVERS))
register(Exercise("07.kda_chunk_step", kda_chunk_step, _step_cases))
