"""Chapter 02, a part of K3 by hand: the latent MoE layer's forward (route, down-project, experts, combine, norm,
up-project, shared experts), on the layer as the tiny K3 builds it."""

from __future__ import annotations

import torch

from k3course.config import K3Config
from k3course.grading.registry import Backward, Case, Exercise, register
from k3course.moe import LatentMoE, MoE


def latent_moe_forward(layer, x):
    """The layer's output in eval mode (no routing is recorded): y [..., d]."""
    return layer(x)


def latent_layer(seed: int, bias: float = 0.3, **changes) -> LatentMoE:
    """The tiny K3's latent MoE layer with seeded weights, a bias of scale ``bias`` and a latent norm away
    from 1, in eval mode; ``changes`` override the config's fields."""
    config = K3Config.preset("tiny")
    layer = LatentMoE.from_config(config, generator=torch.Generator().manual_seed(seed), **changes).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        layer.bias.copy_(bias * torch.randn(layer.bias.shape, generator=g))
        layer.latent_norm.copy_(1 + 0.2 * torch.randn(layer.latent_norm.shape, generator=g))
    return layer


def _tokens(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cases() -> list[Case]:
    return [Case("the tiny K3's layer on [B, T, d] tokens", (latent_layer(1), _tokens(2, 2, 6, 128))),
            Case("no shared expert, [m, d] tokens", (latent_layer(3, n_shared_experts=0), _tokens(4, 9, 128))),
            Case("k = 1", (latent_layer(5, top_k=1), _tokens(6, 7, 128))),
            Case("route_scale 2.5 (the norm after the combine cancels it)", (latent_layer(7, route_scale=2.5),
                                                                     _tokens(8, 5, 128)))]


register(Exercise("02.latent_moe_forward", latent_moe_forward, _cases, backward=Backward(("x",)),
                  package=(MoE.forward,)))
