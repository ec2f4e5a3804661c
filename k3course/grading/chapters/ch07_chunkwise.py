"""Chapter 07 exercises: decayed intra-chunk scores, the UT transform, one whole chunk of KDA.

All three sit in the training path (backward cases, at the strongest decay too) and are multi-step: their probes
switch the decay, β, the incoming state and the mask off one at a time, so a failure names the step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3course.grading.registry import Backward, Case, Exercise, Forbidden, Probe, register
from k3course.ops.chunk import decayed_scores, kda_chunk, kda_chunk_step, ut_transform
from k3course.ops.recurrent import kda_recurrent

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


def _scores_probes():
    """No decay (both masks), a weak decay, then the strongest decay over a long chunk."""
    q, k, _, g, _, _ = _chunk(11, 10, g_low=-0.3)
    no_decay = torch.zeros_like(g)
    strong = torch.full((2, 48, 4), -5.0).cumsum(-2)
    q48, k48 = _chunk(12, 48)[:2]
    return [Probe(Case("G = 0, i ≤ r", (q, k, no_decay, False)), "with no decay (G = 0) and i ≤ r",
                  "check A[r, i] = Σ_d a_rd b_id below and on the diagonal (r is the row, the later token), 0 above"),
            Probe(Case("G = 0, i < r", (k, k, no_decay, True)), "with no decay and strict=True",
                  "strict=True leaves the diagonal out too: i < r"),
            Probe(Case("weak decay", (q, k, g.cumsum(-2), False)), "with a weak decay",
                  "check the factor e^{G_rd − G_id}: per channel d, inside the sum over d, row minus column"),
            Probe(Case("g = -5 over 48 tokens", (q48, k48, strong, True)), "at the strongest decay over 48 tokens",
                  "clamp the exponent G_r − G_i at 0 before exp: above the diagonal it is positive and overflows")]


def _ut_probes():
    """A = 0 (M is Diag(β)), β = 1 (M is the inverse), then both."""
    A, beta = 0.4 * torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(13)).tril(-1), _chunk(14, 8)[4]
    return [Probe(Case("A = 0", (torch.zeros_like(A), beta)), "with A = 0",
                  "with A = 0, M = Diag(β): check the shape and where β goes"),
            Probe(Case("β = 1", (A, torch.ones_like(beta))), "with β = 1",
                  "check the forward substitution X_r = e_r − Σ_{i<r} A_ri X_i (X = (I + A)^{-1}, the sign too)"),
            Probe(Case("A and β", (A, beta)), "with both", "Diag(β) multiplies from the right: column i of X by β_i")]


def _step_probes():
    """β, the decay and the incoming state switched on one at a time, simplest first."""
    q, k, v, g, beta, state = _chunk(15, 8)
    q64, k64, v64, _, beta64, state64 = _chunk(16, 64)
    no_decay, no_write, no_state = torch.zeros_like(g), torch.zeros_like(beta), torch.zeros_like(state)
    return [Probe(Case("β = 0, g = 0", (q, k, v, no_decay, no_write, state)), "with β = 0 and g = 0 (S only read)",
                  "check the query term O = (e^G ⊙ Q) S and that the state passes through"),
            Probe(Case("β = 0", (q, k, v, g, no_write, state)), "with β = 0 (S only decays)",
                  "check G = cumsum(g), inclusive (token r decays by its own g_r too), in (e^G ⊙ Q) S and "
                  "Diag(e^{G_C}) S"),
            Probe(Case("β = 1, g = 0, S = 0", (q, k, v, no_decay, torch.ones_like(beta), no_state)),
                  "with β = 1, g = 0 and S = 0",
                  "check A_kk (strict scores of k, k), M (UT transform), U = M V and O = A_qk U (diagonal included)"),
            Probe(Case("g = 0, S = 0", (q, k, v, no_decay, beta, no_state)), "with β < 1, g = 0 and S = 0",
                  "β scales A_kk's rows: A_kk = Diag(β) · strict scores, and M = (I + A_kk)^{-1} Diag(β)"),
            Probe(Case("S = 0", (q, k, v, g, beta, no_state)), "with a decay and no incoming state (S = 0)",
                  "check the decayed scores (e^{G_r − G_i}) in A_kk and A_qk and the write (K ⊙ e^{G_C − G})ᵀ Ṽ"),
            Probe(Case("g = 0", (q, k, v, no_decay, beta, state)), "with an incoming state and g = 0",
                  "check how the state enters: Ṽ = U − W S, and the query term Q S"),
            Probe(Case("all on", (q, k, v, g, beta, state)), "with an incoming state and a decay",
                  "check where the decay meets the state: W = M(e^G ⊙ K), (e^G ⊙ Q) S and Diag(e^{G_C}) S"),
            Probe(Case("g = -5 over 64 tokens", (q64, k64, v64, torch.full((2, 64, 4), -5.0), beta64, state64)),
                  "at the strongest decay over 64 tokens",
                  "every exponent a difference G_r − G_i ≤ 0 (clamped above the diagonal), never −G alone: "
                  "e^{−G} overflows float32 past 88")]


CHUNK_PIECES = ("k3course.ops.chunk.decayed_scores", "k3course.ops.chunk.ut_transform")

register(Exercise("07.decayed_scores", decayed_scores, _scores_cases, backward=Backward(("a", "b", "G")),
                  probes=_scores_probes))
register(Exercise("07.ut_transform", ut_transform, _ut_cases, forbidden=SOLVERS, backward=Backward(),
                  probes=_ut_probes))
register(Exercise("07.kda_chunk_step", kda_chunk_step, _step_cases, backward=Backward(), probes=_step_probes,
                  package=(kda_chunk, kda_recurrent), may_use=CHUNK_PIECES))
