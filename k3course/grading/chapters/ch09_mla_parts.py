"""Chapter 09, parts of K3 by hand: gated MLA's output gate and the whole attention forward (NoPE as in K3, and
RoPE), on the layer as the tiny K3 builds it."""

from __future__ import annotations

import torch

from k3course.config import K3Config
from k3course.grading.registry import Backward, Case, Exercise, register
from k3course.layers.mla import GatedMLA, output_gate


def gated_mla_forward(layer, x):
    """The layer's output y [B, T, d] on a fresh sequence (no cache), in eval mode."""
    return layer(x)[0]


def mla_layer(seed: int, **changes) -> GatedMLA:
    """The tiny K3's gated MLA layer with seeded weights and norms away from 1, in eval mode."""
    torch.manual_seed(seed)
    layer = GatedMLA.from_config(K3Config.preset("tiny"), **changes).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for norm in (layer.q_norm, layer.kv_norm):
            if norm is not None:
                norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=g))
    return layer


def _tokens(seed: int, B: int, T: int, d: int = 128) -> torch.Tensor:
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed))


def _forward_cases() -> list[Case]:
    return [Case("the tiny K3's layer (NoPE), T = 7", (mla_layer(1), _tokens(2, 2, 7))),
            Case("RoPE on the 16 rope dims, T = 9", (mla_layer(3, use_rope=True), _tokens(4, 1, 9))),
            Case("no output gate", (mla_layer(5, gated=False), _tokens(6, 2, 5))),
            Case("a full-rank query (q_lora_rank None), T = 1", (mla_layer(7, q_lora_rank=None), _tokens(8, 3, 1)))]


def _gate_cases() -> list[Case]:
    g = torch.Generator().manual_seed(9)
    heads, x, weight = torch.randn(2, 5, 4 * 32, generator=g), torch.randn(2, 5, 128, generator=g), \
        torch.randn(4 * 32, 128, generator=g) / 128 ** 0.5
    return [Case("the tiny K3's sizes", (heads, x, weight)),
            Case("large gate inputs (σ saturates)", (heads, 20 * x, weight)),
            Case("bfloat16 keeps its dtype", (heads.bfloat16(), x.bfloat16(), weight.bfloat16())),
            Case("d ≠ H·v: the gate reads the layer input", (heads[..., :48], x, weight[:48]))]


register(Exercise("09.mla_output_gate", output_gate, _gate_cases, backward=Backward()))
register(Exercise("09.gated_mla_forward", gated_mla_forward, _forward_cases, tolerance={"float32": (1e-4, 1e-5)},
                  backward=Backward(("x",)), package=(GatedMLA.forward,),
                  may_use=("k3course.layers.mla.rope_rotate",)))
