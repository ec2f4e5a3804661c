"""Chapter 06, a part of K3 by hand: the full KDA layer (projections, short convolutions, L2 norms, β, gate,
the KDA op, per-head norm, output gate, output projection), on the layer as the tiny K3 builds it."""

from __future__ import annotations

import torch

from k3course.config import K3Config
from k3course.grading.registry import Backward, Case, Exercise, register
from k3course.layers import KimiDeltaAttention


def kda_layer_forward(layer, x):
    """The layer's output y [B, T, d] on a fresh sequence (no cache), in eval mode."""
    return layer(x)[0]


def kda_layer(seed: int, **changes) -> KimiDeltaAttention:
    """The tiny K3's KDA layer with seeded weights (norm and gate weights away from their starting values), eval
    mode, 16-token chunks (so short sequences take the recurrent path and longer ones the chunked one)."""
    torch.manual_seed(seed)
    layer = KimiDeltaAttention.from_config(K3Config.preset("tiny"), chunk_size=16, **changes).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        layer.o_norm_weight.copy_(1 + 0.3 * torch.randn(layer.o_norm_weight.shape, generator=g))
        layer.dt_bias.add_(0.5 * torch.randn(layer.dt_bias.shape, generator=g))
    return layer


def _tokens(seed: int, B: int, T: int) -> torch.Tensor:
    return torch.randn(B, T, 128, generator=torch.Generator().manual_seed(seed))


def _cases() -> list[Case]:
    return [Case("the tiny K3's layer, T = 10 (recurrent path)", (kda_layer(1), _tokens(2, 2, 10))),
            Case("T = 40: three chunks, the last one short", (kda_layer(3), _tokens(4, 1, 40))),
            Case("T = 1", (kda_layer(5), _tokens(6, 2, 1))),
            Case("Kimi Linear's layer: low-rank output gate, unbounded softplus gate",
                 (kda_layer(7, output_gate="low_rank", lower_bound=None), _tokens(8, 1, 12)))]


register(Exercise("06.kda_layer_forward", kda_layer_forward, _cases, tolerance={"float32": (1e-4, 1e-5)},
                  backward=Backward(("x",)), package=(KimiDeltaAttention.forward,),
                  may_use=("k3course.ops.kda_recurrent", "k3course.ops.kda_chunk")))
