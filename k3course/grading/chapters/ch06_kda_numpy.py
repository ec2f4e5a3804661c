"""Chapter 06, the NumPy rung: KDA's recurrence with a channel-wise decay."""

from __future__ import annotations

from k3course.grading.chapters.ch04_decay_gates_numpy import initial_state, sequence_case
from k3course.grading.registry import NUMPY_ONLY, Case, Exercise, register
from k3course.reference import linear_attention as ref


def kda_numpy(q, k, v, g, beta, scale=None, initial_state=None):
    """S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t-1} + β_t k_t v_tᵀ; o_t = S_tᵀ (scale·q_t). g [B, T, H, K],
    beta [B, T, H]. Returns (o [B, T, H, V], final state [B, H, K, V])."""
    return ref.kda(q, k, v, g, beta, scale, initial_state)


def _cases() -> list[Case]:
    return [Case("T = 7, K = 4, V = 3", sequence_case(1, 7, beta=True)),
            Case("an initial state", sequence_case(2, 5, beta=True), {"initial_state": initial_state(3)}),
            Case("K = V = 4 (decay on the wrong axis would fit the shapes)", sequence_case(4, 6, V=4, beta=True),
                 {"initial_state": initial_state(5, V=4)}),
            Case("K3's strongest decay, g down to -5", sequence_case(6, 9, strength=5.0, beta=True)),
            Case("explicit scale, T = 1", sequence_case(7, 1, beta=True), {"scale": 0.5})]


register(Exercise("06.kda_numpy", kda_numpy, _cases, forbidden=NUMPY_ONLY,
                  package=(ref.kda,)))
