"""Chapter 04, the NumPy rung: decayed linear attention as a recurrence over time."""

from __future__ import annotations

import numpy as np

from k3course.grading.registry import NUMPY_ONLY, Case, Exercise, register
from k3course.reference import linear_attention as ref


def decay_recurrence_numpy(q, k, v, g, scale=None, initial_state=None):
    """S_t = Diag(e^{g_t}) S_{t-1} + k_t v_tᵀ; o_t = S_tᵀ (scale·q_t). g [B, T, H] or [B, T, H, K].
    Returns (o [B, T, H, V], final state [B, H, K, V])."""
    return ref.decay_linear_attention(q, k, v, g, scale, initial_state)


def sequence_case(seed: int, T: int, gate: str = "channel", strength: float = 1.0, H: int = 2, K: int = 4,
                  V: int = 3, beta: bool = False) -> tuple:
    """Seeded (q, k, v, g[, beta]) in float64: keys of unit norm, g = −strength·U(0, 1) per head or channel."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, T, H, K)), rng.standard_normal((2, T, H, K)), rng.standard_normal((2, T, H, V))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -strength * rng.random((2, T, H, K) if gate == "channel" else (2, T, H))
    return (q, k, v, g, rng.random((2, T, H))) if beta else (q, k, v, g)


def initial_state(seed: int, H: int = 2, K: int = 4, V: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, H, K, V))


def _cases() -> list[Case]:
    return [Case("channel gate (GLA), T = 7", sequence_case(1, 7)),
            Case("scalar gate per head", sequence_case(2, 6, "scalar")),
            Case("an initial state", sequence_case(3, 5), {"initial_state": initial_state(4)}),
            Case("explicit scale", sequence_case(5, 4), {"scale": 0.3}),
            Case("T = 1", sequence_case(6, 1)),
            Case("strong decay, g down to -5", sequence_case(7, 9, strength=5.0), {"initial_state": initial_state(8)})]


register(Exercise("04.decay_recurrence_numpy", decay_recurrence_numpy, _cases, forbidden=NUMPY_ONLY,
                  package=(ref.decay_linear_attention, ref.linear_attention)))
