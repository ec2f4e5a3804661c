"""Chapter 09 (gated MLA): the compressed cache, the attention weights, the absorbed query, the cache size."""

from __future__ import annotations

import torch

from k3course.accounting import mla_cache_numbers
from k3course.grading.registry import Backward, Case, Exercise, register
from k3course.layers.mla import absorb_query, attention_probs, compress_kv


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _compress_cases() -> list[Case]:
    g = torch.Generator().manual_seed(900)
    cases = []
    for name, (batch, length, d, rank, rope) in {"small": (2, 5, 16, 6, 4), "K3 ratio 512:64": (1, 3, 32, 16, 2),
                                                 "one token": (1, 1, 8, 4, 2), "no rope dims": (2, 4, 8, 4, 0)}.items():
        weight = _randn(g, rank + rope, d) * d ** -0.5
        norm = 1.0 + 0.1 * _randn(g, rank)
        cases.append(Case(name, (_randn(g, batch, length, d), weight, norm, rank)))
    x = _randn(g, 1, 4, 8) * 1e3                                       # RMSNorm must undo the scale
    cases.append(Case("large inputs", (x, _randn(g, 6, 8), torch.ones(4), 4)))
    cases.append(Case("tiny inputs (eps inside the square root)", (x * 1e-7, _randn(g, 6, 8), torch.ones(4), 4)))
    small = cases[0].args
    cases.append(Case("float64 inputs keep their dtype", (*(t.double() for t in small[:3]), small[3])))
    return cases


def _probs_cases() -> list[Case]:
    g = torch.Generator().manual_seed(901)
    cases = []
    shapes = {"small": (2, 5, 3, 4, 2), "one head": (1, 6, 1, 8, 4), "one token": (2, 1, 2, 4, 2),
              "rope wider": (1, 4, 2, 2, 6)}
    for name, (batch, length, heads, nope, rope) in shapes.items():
        cases.append(Case(name, (_randn(g, batch, length, heads, nope), _randn(g, batch, length, heads, rope),
                                 _randn(g, batch, length, heads, nope), _randn(g, batch, length, rope))))
    large = tuple(20 * t for t in cases[0].args)
    cases.append(Case("large scores (the softmax must subtract its max)", large))
    cases.append(Case("every score far below 0 (about -1e5)", _far_below_zero(g, 2, 5, 3, 4, 2)))
    cases.append(Case("bfloat16 inputs: weights in fp32", tuple(t.bfloat16() for t in cases[0].args)))
    return cases


def _far_below_zero(g: torch.Generator, batch: int, length: int, heads: int, nope: int, rope: int):
    """(q_nope, q_rope, k_nope, k_rope) whose scores q·k are all far below 0: q and k point opposite ways."""
    direction = torch.ones(nope)
    q_nope = 300 * direction + _randn(g, batch, length, heads, nope)
    k_nope = -300 * direction + _randn(g, batch, length, heads, nope)
    return q_nope, _randn(g, batch, length, heads, rope), k_nope, _randn(g, batch, length, rope)


def _absorb_cases() -> list[Case]:
    g = torch.Generator().manual_seed(902)
    shapes = {"small": (2, 3, 4, 5, 6), "one head": (1, 2, 1, 8, 3), "rank below nope": (1, 4, 2, 6, 2),
              "K3 ratio 128:512": (1, 2, 2, 4, 16)}
    cases = [Case(name, (_randn(g, b, t, h, n), _randn(g, h, n, r))) for name, (b, t, h, n, r) in shapes.items()]
    return [*cases, Case("float64 inputs keep their dtype", tuple(t.double() for t in cases[0].args))]


def mla_layer_cache_numbers(n_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                            kv_lora_rank: int) -> int:
    """The package reference: numbers one MLA layer caches per token, given all of its dimensions."""
    return mla_cache_numbers(kv_lora_rank, qk_rope_head_dim)


def _cache_cases() -> list[Case]:
    return [Case("kimi-k3", (96, 128, 64, 128, 512)), Case("deepseek-v3", (128, 128, 64, 128, 512)),
            Case("tiny preset", (4, 32, 16, 32, 32)), Case("one head", (1, 16, 8, 16, 64)),
            Case("no rope dims", (8, 64, 0, 64, 256))]


register(Exercise("09.compress_kv", compress_kv, _compress_cases, backward=Backward()))
register(Exercise("09.attention_probs", attention_probs, _probs_cases, backward=Backward()))
register(Exercise("09.absorb_query", absorb_query, _absorb_cases, backward=Backward()))
register(Exercise("09.mla_cache_numbers", mla_layer_cache_numbers, _cache_cases, package=(mla_cache_numbers,)))
