"""Chapter 04 exercises: one step of decayed linear attention, its parallel form, the whole recurrence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3course.grading.registry import Backward, Case, Exercise, Probe, register
from k3course.ops.parallel import decay_attention_parallel
from k3course.ops.recurrent import decay_step, gla_recurrent


def _step_inputs(seed, gate_shape, unit_keys=True):
    gen = torch.Generator().manual_seed(seed)
    B, H, K, V = 2, 3, 4, 5
    state = torch.randn(B, H, K, V, generator=gen)
    q, k = torch.randn(B, H, K, generator=gen), torch.randn(B, H, K, generator=gen)
    k = F.normalize(k, dim=-1) if unit_keys else k
    v = torch.randn(B, H, V, generator=gen)
    g = -2 * torch.rand(*gate_shape, generator=gen)
    return state, q, k, v, g


def _as(dtype, tensors):
    return tuple(x.to(dtype) for x in tensors)


def _step_cases():
    return [Case("scalar gate per head", _step_inputs(0, (2, 3))),
            Case("channel gate (GLA)", _step_inputs(1, (2, 3, 4))),
            Case("g = 0: plain linear attention", _step_inputs(2, (2, 3))[:4] + (torch.zeros(2, 3),)),
            Case("keys not of unit norm", _step_inputs(10, (2, 3, 4), unit_keys=False)),
            Case("float64 inputs keep their dtype", _as(torch.float64, _step_inputs(11, (2, 3, 4))))]


def _sequence_inputs(seed, T, scalar, strength=1.5):
    gen = torch.Generator().manual_seed(seed)
    B, H, K, V = 2, 2, 4, 3
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    g = -strength * torch.rand(*((B, T, H) if scalar else (B, T, H, K)), generator=gen)
    return q, k, v, g


def _parallel_cases():
    return [Case("scalar gate, T = 9", _sequence_inputs(3, 9, True)),
            Case("channel gate, T = 12", _sequence_inputs(4, 12, False)),
            Case("T = 1", _sequence_inputs(5, 1, False)),
            Case("explicit scale", _sequence_inputs(6, 7, False), {"scale": 0.3}),
            Case("T = 64 at the strongest decay g = -5 (e^{-G} overflows)",
                 _sequence_inputs(12, 64, False)[:3] + (torch.full((2, 64, 2, 4), -5.0),)),
            Case("bfloat16 inputs: computed in float32, returned in bfloat16",
                 _as(torch.bfloat16, _sequence_inputs(13, 8, True)))]


def _recurrent_cases():
    q, k, v, g = _sequence_inputs(7, 11, False)
    state = torch.randn(2, 2, 4, 3, generator=torch.Generator().manual_seed(8))
    return [Case("channel gate, final state", (q, k, v, g), {"output_final_state": True}),
            Case("scalar gate, initial and final state", _sequence_inputs(9, 6, True),
                 {"initial_state": state, "output_final_state": True}),
            Case("no final state asked", (q, k, v, g)),
            Case("T = 64, strong decay", _sequence_inputs(14, 64, False, strength=5.0), {"output_final_state": True}),
            Case("bfloat16 inputs: o in bfloat16, the state in float32", _as(torch.bfloat16, (q, k, v, g)),
                 {"output_final_state": True})]


def recurrence_probes(inputs: tuple, state, step: str) -> list[Probe]:
    """Probes of a whole recurrence (04's and 05's): the loop alone (scale 1, from zeros), then the default scale,
    then an initial state. ``step`` is the one-token update, for the first hint."""
    return [Probe(Case("scale 1, from zeros", inputs, {"scale": 1.0, "output_final_state": True}),
                  "with scale = 1 and no initial state",
                  f"check the loop: {step}, o_t = S_tᵀ q_t from the new state, the final state after the last token"),
            Probe(Case("default scale", inputs, {"output_final_state": True}), "with the default scale",
                  "scale=None means K^{-1/2}: multiply the queries by it"),
            Probe(Case("initial state", inputs, {"initial_state": state, "output_final_state": True}),
                  "with an initial state", "start the loop from initial_state (not zeros), and leave it unchanged")]


def _recurrent_probes():
    state = torch.randn(2, 2, 4, 3, generator=torch.Generator().manual_seed(15))
    return recurrence_probes(_sequence_inputs(16, 5, False), state, "S_t = Diag(e^{g_t}) S_{t-1} + k_t v_tᵀ")


register(Exercise("04.decay_step", decay_step, _step_cases, backward=Backward()))
register(Exercise("04.decay_attention_parallel", decay_attention_parallel, _parallel_cases, backward=Backward()))
register(Exercise("04.gla_recurrent", gla_recurrent, _recurrent_cases, backward=Backward(), probes=_recurrent_probes,
                  may_use=("k3course.ops.recurrent.decay_step",)))
