"""Chapter 05 exercises: one delta-rule step, one gated DeltaNet step, the whole GDN recurrence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3course.grading.chapters.ch04_decay_gates import recurrence_probes
from k3course.grading.registry import Backward, Case, Exercise, Probe, register
from k3course.ops.recurrent import delta_step, gdn_recurrent, gdn_step


def _step_inputs(seed, with_gate, unit_keys=True):
    gen = torch.Generator().manual_seed(seed)
    B, H, K, V = 2, 3, 4, 5
    state = torch.randn(B, H, K, V, generator=gen)
    q, k = torch.randn(B, H, K, generator=gen), torch.randn(B, H, K, generator=gen)
    k = F.normalize(k, dim=-1) if unit_keys else 0.7 * k
    v, beta = torch.randn(B, H, V, generator=gen), torch.rand(B, H, generator=gen)
    if not with_gate:
        return state, q, k, v, beta
    return state, q, k, v, -2 * torch.rand(B, H, generator=gen), beta


def _delta_cases():
    state, q, k, v, beta = _step_inputs(0, False)
    return [Case("random β", (state, q, k, v, beta)),
            Case("β = 1: the key's value is overwritten", (state, q, k, v, torch.ones_like(beta))),
            Case("β = 0: nothing is written", (state, q, k, v, torch.zeros_like(beta))),
            Case("keys not of unit norm", _step_inputs(6, False, unit_keys=False)),
            Case("float64 inputs keep their dtype", _as(torch.float64, _step_inputs(7, False)))]


def _gdn_step_cases():
    state, q, k, v, g, beta = _step_inputs(1, True)
    return [Case("random gate and β", (state, q, k, v, g, beta)),
            Case("strong decay g = -5", (state, q, k, v, torch.full_like(g, -5.0), beta)),
            Case("g = 0 is DeltaNet", (state, q, k, v, torch.zeros_like(g), beta)),
            Case("keys not of unit norm", _step_inputs(8, True, unit_keys=False)),
            Case("float64 inputs keep their dtype", _as(torch.float64, _step_inputs(9, True)))]


def _as(dtype, tensors):
    return tuple(x.to(dtype) for x in tensors)


def _sequence_inputs(seed, T, strength=1.0):
    gen = torch.Generator().manual_seed(seed)
    B, H, K, V = 2, 2, 4, 3
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    g, beta = -strength * torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


def _recurrent_cases():
    state = torch.randn(2, 2, 4, 3, generator=torch.Generator().manual_seed(2))
    return [Case("T = 10, final state", _sequence_inputs(3, 10), {"output_final_state": True}),
            Case("initial and final state", _sequence_inputs(4, 7),
                 {"initial_state": state, "output_final_state": True}),
            Case("T = 1, explicit scale", _sequence_inputs(5, 1), {"scale": 0.7}),
            Case("T = 64, strong decay", _sequence_inputs(10, 64, strength=5.0), {"output_final_state": True}),
            Case("bfloat16 inputs: o in bfloat16, the state in float32", _as(torch.bfloat16, _sequence_inputs(11, 6)),
                 {"output_final_state": True})]


def _recurrent_probes():
    state = torch.randn(2, 2, 4, 3, generator=torch.Generator().manual_seed(16))
    return recurrence_probes(_sequence_inputs(17, 5), state, "S_t = e^{g_t}(I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ")


def gated_step_probes(inputs: tuple, decay: str, decayed_state: str) -> list[Probe]:
    """Probes of one gated delta-rule step (05's and 06's): the decay, the write (β) and the incoming state
    switched off one at a time, simplest first. ``inputs``: (state, q, k, v, g, beta); ``decay`` says what the
    gate does to S and ``decayed_state`` writes the decayed S, for the hints."""
    state, q, k, v, g, beta = inputs
    no_decay, no_write = torch.zeros_like(g), torch.zeros_like(beta)
    return [Probe(Case("g = 0, β = 0", (state, q, k, v, no_decay, no_write)), "with g = 0 and β = 0 (S is only read)",
                  "check the output o_t = S_tᵀ q_t: read from the new state, q unscaled"),
            Probe(Case("β = 0", (state, q, k, v, g, no_write)), "with β = 0 (S only decays)",
                  f"check the decay: {decay}, and o read from the decayed state"),
            Probe(Case("g = 0", (state, q, k, v, no_decay, beta)), "with g = 0 (the delta rule alone)",
                  "check the delta correction S + β k (v − Sᵀk)ᵀ"),
            Probe(Case("S = 0", (torch.zeros_like(state), q, k, v, g, beta)),
                  "with no incoming state (S = 0) under a decay",
                  "decay the old state first, then correct and write: the new write βkvᵀ is not decayed"),
            Probe(Case("all on", (state, q, k, v, g, beta)), "with a state, a decay and a write together",
                  f"the correction reads the decayed state: v − ({decayed_state})ᵀ k")]


def _gdn_step_probes():
    return gated_step_probes(_step_inputs(18, True), "the whole state times e^{g}", "e^g S")


register(Exercise("05.delta_step", delta_step, _delta_cases, backward=Backward()))
register(Exercise("05.gdn_step", gdn_step, _gdn_step_cases, backward=Backward(), probes=_gdn_step_probes))
register(Exercise("05.gdn_recurrent", gdn_recurrent, _recurrent_cases, backward=Backward(), probes=_recurrent_probes,
                  may_use=("k3course.ops.recurrent.gdn_step",)))
