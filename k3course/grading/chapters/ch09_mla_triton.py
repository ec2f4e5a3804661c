"""Chapter 09, the Triton rung: gated MLA's causal prefill attention as a FlashAttention-style forward kernel
(online softmax over key blocks), returning o and the log-sum-exp. The reference is the package's kernel;
inputs are small fp32 tensors (the interpreter is slow)."""

from __future__ import annotations

import torch

from k3course.grading.chapters.ch08_triton import TORCH_MATH
from k3course.grading.registry import Case, Exercise, register
from k3course.kernels.flash_mla import flash_mla_attention, flash_mla_forward


def _attention_inputs(B: int, T: int, H: int, n: int, e: int, v: int, seed: int, start: int = 0,
                      score_size: float = 1.0, strided: bool = False) -> tuple:
    """Seeded q_nope [B, T, H, n], q_rope [B, T, H, e], k_nope [B, S, H, n], k_rope [B, S, e], values [B, S, H, v]
    (S = start + T); queries multiplied by ``score_size``; ``strided``: q_nope and q_rope are views of one
    [B, T, H, n + e] tensor and values a transposed [B, H, S, v] tensor, as the layer hands them over."""
    gen = torch.Generator().manual_seed(seed)
    S = start + T
    query = score_size * torch.randn(B, T, H, n + e, generator=gen)
    q_nope, q_rope = query.split([n, e], dim=-1)
    if not strided:
        q_nope, q_rope = q_nope.contiguous(), q_rope.contiguous()
    k_nope, k_rope = torch.randn(B, S, H, n, generator=gen), torch.randn(B, S, e, generator=gen)
    values = torch.randn(B, H, S, v, generator=gen).transpose(1, 2)
    return q_nope, q_rope, k_nope, k_rope, values if strided else values.contiguous()


def _forward_cases() -> list[Case]:
    def case(name, B, T, H, n, e, v, seed, scale=None, start=0, **kwargs):
        inputs = _attention_inputs(B, T, H, n, e, v, seed, start, **kwargs)
        return Case(name, (*inputs, (n + e) ** -0.5 if scale is None else scale), {"start": start})
    return [
        case("T = 16: one query block, one key block, n = e = v = 16", 1, 16, 1, 16, 16, 16, 90),
        case("T = 37 (odd): the last query and key blocks partial; n = 16, e = 8, v = 12 (masked widths)",
             1, 37, 2, 16, 8, 12, 91),
        case("a cache prefix of 5 keys (start = 5, S = T + 5): the diagonal shifts; scale 0.3, batch 2",
             2, 20, 1, 16, 8, 16, 92, scale=0.3, start=5),
        case("one token after a prefix of 20 keys (start = 20): it sees every key", 1, 1, 2, 16, 8, 16, 93,
             start=20),
        case("large scores (queries × 30): the running max changes between key blocks", 1, 40, 1, 16, 8, 16, 94,
             score_size=30.0),
        case("strided: q_nope, q_rope views of one [B, T, H, n + e] tensor, values transposed; scale 0.05",
             1, 21, 2, 16, 8, 16, 95, scale=0.05, strided=True),
    ]


register(Exercise("09.flash_mla_forward", flash_mla_forward, _forward_cases, forbidden=TORCH_MATH, isolate=True,
                  tolerance={"float32": (1e-5, 1e-5)}, package=(flash_mla_attention,), guard_bands=True))
