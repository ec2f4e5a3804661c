"""Chapter 12 (train and validate): the warmup + cosine learning-rate factor, an add-k byte n-gram baseline."""

from __future__ import annotations

import numpy as np
import torch

from k3course.data import ngram_bits_per_byte
from k3course.grading.registry import Case, Exercise, register
from k3course.train import lr_factor


def _schedule_cases() -> list[Case]:
    cases = []
    for step in (0, 3, 9, 10, 11, 55, 99, 100, 130):
        cases.append(Case(f"step {step} of 100, warmup 10", (step, 10, 100, 0.1)))
    cases.append(Case("no warmup, first step", (0, 0, 50, 0.0)))
    cases.append(Case("no warmup, floor 0.5", (30, 0, 50, 0.5)))
    for step in (7, 19, 20, 25):
        cases.append(Case(f"warmup is the whole run (20 steps), step {step}", (step, 20, 20, 0.1)))
    return cases


def _bytes(text: bytes) -> torch.Tensor:
    """A byte string as a uint8 tensor [len]."""
    return torch.tensor(list(text), dtype=torch.uint8)


def _text(rng: np.random.Generator, n: int, alphabet: bytes) -> torch.Tensor:
    return _bytes(bytes(rng.choice(list(alphabet), size=n)))


def _ngram_cases() -> list[Case]:
    rng = np.random.default_rng(1200)
    code = _bytes(b"def f(x):\n    return x + 1\n" * 20)
    held_out = _bytes(b"def g(y):\n    return y * 2\n")
    cases = []
    for order in (1, 2, 3):
        cases.append(Case(f"code, order {order}", (code, held_out, order, 0.1)))
    cases.append(Case("random bytes, order 2, k = 1", (_text(rng, 500, b"abcdef"), _text(rng, 80, b"abcdefg"), 2, 1.0)))
    cases.append(Case("unseen history, order 3", (_text(rng, 300, b"ab"), _text(rng, 40, b"xyz"), 3, 0.5)))
    return cases


register(Exercise("12.lr_factor", lr_factor, _schedule_cases))
register(Exercise("12.ngram_bits_per_byte", ngram_bits_per_byte, _ngram_cases))
