"""Chapter 06 exercises: one KDA step, the bounded forget gate, the causal short convolution.

All three sit in the training path (backward cases); ``kda_step`` is multi-step, and its probes switch the decay,
the write and the incoming state off one at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3course.grading.chapters.ch05_gated_deltanet import gated_step_probes
from k3course.grading.registry import Backward, Case, Exercise, register
from k3course.layers.kda import kda_gate, short_conv
from k3course.ops.chunk import kda_chunk, kda_chunk_step
from k3course.ops.recurrent import kda_step


def _step_inputs(seed: int = 0):
    """(state, q, k, v, g, beta) of one step for B = 2, H = 3, K = 4, V = 5: unit keys, g in (-3, 0)."""
    gen = torch.Generator().manual_seed(seed)
    B, H, K, V = 2, 3, 4, 5
    state = torch.randn(B, H, K, V, generator=gen)
    q, k = torch.randn(B, H, K, generator=gen), F.normalize(torch.randn(B, H, K, generator=gen), dim=-1)
    v, beta = torch.randn(B, H, V, generator=gen), torch.rand(B, H, generator=gen)
    return state, q, k, v, -3 * torch.rand(B, H, K, generator=gen), beta


def _step_probes():
    return gated_step_probes(_step_inputs(20), "row i of S (key channel i) times e^{g_i}", "Diag(e^g) S")


def _step_cases():
    gen = torch.Generator().manual_seed(0)
    B, H, K, V = 2, 3, 4, 5
    state = torch.randn(B, H, K, V, generator=gen)
    q, k = torch.randn(B, H, K, generator=gen), F.normalize(torch.randn(B, H, K, generator=gen), dim=-1)
    v, beta = torch.randn(B, H, V, generator=gen), torch.rand(B, H, generator=gen)
    g = -3 * torch.rand(B, H, K, generator=gen)
    return [Case("random channel gate", (state, q, k, v, g, beta)),
            Case("gate at the lower bound -5", (state, q, k, v, torch.full_like(g, -5.0), beta)),
            Case("channel-constant gate (GDN)", (state, q, k, v, g[..., :1].expand_as(g).contiguous(), beta)),
            Case("β = 1", (state, q, k, v, g, torch.ones_like(beta))),
            Case("keys not of unit norm", (state, q, 0.6 * torch.randn(B, H, K, generator=gen), v, g, beta)),
            Case("float64 inputs keep their dtype", tuple(x.double() for x in (state, q, k, v, g, beta)))]


def _gate_cases():
    gen = torch.Generator().manual_seed(1)
    B, T, H, K = 2, 3, 2, 4
    z = 3 * torch.randn(B, T, H, K, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H, K, generator=gen)
    return [Case("K3 bounded gate", (z, A_log, dt_bias)),
            Case("another lower bound", (z, A_log, dt_bias), {"lower_bound": -2.0}),
            Case("Kimi Linear unbounded gate", (z, A_log, dt_bias), {"lower_bound": None}),
            Case("large z: softplus must not overflow", (30 * z, A_log, dt_bias), {"lower_bound": None}),
            Case("float64 inputs keep their dtype", (z.double(), A_log.double(), dt_bias.double()))]


def _conv_cases():
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(2, 7, 6, generator=gen), torch.randn(6, 4, generator=gen)
    cache = torch.randn(2, 3, 6, generator=gen)
    return [Case("zeros before t = 0", (x, weight)),
            Case("with the previous inputs as cache", (x, weight, cache)),
            Case("one token (decoding)", (x[:, :1], weight, cache)),
            Case("float64 inputs keep their dtype (zeros too)", (x.double(), weight.double()))]


register(Exercise("06.kda_step", kda_step, _step_cases, backward=Backward(), probes=_step_probes,
                  package=(kda_chunk_step, kda_chunk)))
register(Exercise("06.kda_gate", kda_gate, _gate_cases, backward=Backward()))
register(Exercise("06.short_conv", short_conv, _conv_cases, backward=Backward()))
