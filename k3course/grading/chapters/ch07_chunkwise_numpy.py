"""Chapter 07, the NumPy rung: chunkwise KDA (UT transform by forward substitution, W and U, state passing)."""

from __future__ import annotations

from k3course.grading.chapters.ch04_decay_gates_numpy import initial_state, sequence_case
from k3course.grading.registry import NUMPY_ONLY, Case, Exercise, register
from k3course.reference import chunkwise as ref
from k3course.reference import linear_attention as recurrence


def kda_chunkwise_numpy(q, k, v, g, beta, chunk_size, initial_state=None):
    """KDA chunk by chunk (the last chunk may be shorter), queries scaled by K^-1/2. q, k, g [B, T, H, K];
    v [B, T, H, V]; beta [B, T, H] -> (o [B, T, H, V], final state [B, H, K, V])."""
    return ref.kda_chunkwise(q, k, v, g, beta, chunk_size, initial_state=initial_state)


def _cases() -> list[Case]:
    return [Case("T = 8 in chunks of 4", (*sequence_case(1, 8, beta=True), 4)),
            Case("T = 11 in chunks of 4: a short last chunk", (*sequence_case(2, 11, beta=True), 4),
                 {"initial_state": initial_state(3)}),
            Case("one chunk longer than the sequence", (*sequence_case(4, 5, beta=True), 8)),
            Case("chunks of 1 token", (*sequence_case(5, 4, beta=True), 1), {"initial_state": initial_state(6)}),
            Case("K3's strongest decay, chunks of 3", (*sequence_case(7, 9, strength=5.0, V=4, beta=True), 3),
                 {"initial_state": initial_state(8, V=4)})]


register(Exercise("07.kda_chunkwise_numpy", kda_chunkwise_numpy, _cases, forbidden=NUMPY_ONLY,
                  package=(ref.kda_chunkwise, ref.kda_chunk_step, recurrence.kda)))
