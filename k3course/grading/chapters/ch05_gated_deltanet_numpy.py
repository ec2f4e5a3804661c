"""Chapter 05, the NumPy rung: the gated delta rule, one token at a time."""

from __future__ import annotations

from k3course.grading.chapters.ch04_decay_gates_numpy import initial_state, sequence_case
from k3course.grading.registry import NUMPY_ONLY, Case, Exercise, register
from k3course.reference import linear_attention as ref


def gated_delta_numpy(q, k, v, g, beta, scale=None, initial_state=None):
    """S_t = e^{g_t} (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ; o_t = S_tᵀ (scale·q_t). g, beta [B, T, H].
    Returns (o [B, T, H, V], final state [B, H, K, V])."""
    return ref.gated_delta_rule(q, k, v, g, beta, scale, initial_state)


def _cases() -> list[Case]:
    return [Case("T = 7", sequence_case(1, 7, "scalar", beta=True)),
            Case("an initial state", sequence_case(2, 5, "scalar", beta=True), {"initial_state": initial_state(3)}),
            Case("g = 0: the plain delta rule", (*sequence_case(4, 6, "scalar", strength=0.0, beta=True),),
                 {"initial_state": initial_state(5)}),
            Case("explicit scale, strong decay", sequence_case(6, 8, "scalar", strength=5.0, beta=True),
                 {"scale": 0.7}),
            Case("T = 1", sequence_case(7, 1, "scalar", beta=True), {"initial_state": initial_state(8)})]


register(Exercise("05.gated_delta_numpy", gated_delta_numpy, _cases, forbidden=NUMPY_ONLY,
                  package=(ref.gated_delta_rule, ref.kda)))
