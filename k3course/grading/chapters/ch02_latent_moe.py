"""Chapter 02 exercises: SiTU-GLU, the latent combine RMSNorm(Σ p E) W↑, all-to-all bytes per token."""

from __future__ import annotations

import torch

from k3course.grading import Backward, Case, Exercise, register
from k3course.moe import all_to_all_bytes_per_token, latent_combine, situ_glu


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _situ_cases() -> list[Case]:
    small = torch.randn(2, 50, generator=_generator(1))
    large = 30 * torch.randn(2, 50, generator=_generator(2))  # far into both caps
    return [
        Case("small inputs (close to SwiGLU)", (small[0], small[1])),
        Case("large inputs (the caps bite)", (large[0], 3 * large[1])),
        Case("other betas", (large[0], large[1]), {"beta1": 2.0, "beta2": 10.0}),
        Case("huge inputs (tanh must not be built from exp)", (1e3 * small[0], 1e3 * small[1])),
        Case("float64 inputs keep their dtype", (small[0].double(), small[1].double())),
    ]


def _combine_cases() -> list[Case]:
    g = _generator(3)
    out, weights = torch.randn(13, 4, 8, generator=g), torch.softmax(torch.randn(13, 4, generator=g), -1)
    up, norm = torch.randn(8, 16, generator=g), 1 + 0.1 * torch.randn(8, generator=g)
    single = (torch.randn(1, 1, 8, generator=g), torch.ones(1, 1), up, norm)
    sigmoid = torch.sigmoid(torch.randn(13, 4, generator=g))
    return [Case("m=13, k=4, latent 8 -> d 16", (out, weights, up, norm)),
            Case("k=1, one token", single),
            Case("eps = 0.1", (out, weights, up, norm), {"eps": 0.1}),
            Case("tiny expert outputs (eps inside the square root)", (1e-4 * out, weights, up, norm)),
            Case("tiny outputs, weights that do not sum to 1 (sigmoid router)", (1e-4 * out, sigmoid, up, norm)),
            Case("bfloat16 inputs keep their dtype", tuple(t.bfloat16() for t in (out, weights, up, norm)))]


def _bytes_cases() -> list[Case]:
    return [
        Case("K3: d=7168, k=16, latent 3584, bf16", (7168, 16, 3584)),
        Case("K2: d=7168, k=8, no latent", (7168, 8)),
        Case("fp8 dispatch", (4096, 8, 1024), {"bytes_per_value": 1}),
    ]


register(Exercise("02.situ_glu", situ_glu, _situ_cases, backward=Backward()))
register(Exercise("02.latent_combine", latent_combine, _combine_cases, backward=Backward()))
register(Exercise("02.all_to_all_bytes_per_token", all_to_all_bytes_per_token, _bytes_cases))
