"""Chapter 12 (train and validate): the warmup + cosine learning-rate factor, an add-k byte n-gram baseline, one
optimizer step (accumulation, clipping, the balancing-bias update) and the validation number in bits per byte."""

from __future__ import annotations

import numpy as np
import torch

from k3course.config import K3Config
from k3course.data import ngram_bits_per_byte
from k3course.grading.registry import Case, Exercise, register
from k3course.model import K3Model
from k3course.train import LN2, TrainConfig, evaluate, lr_factor, make_optimizer, train_step


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


def _small_model(seed: int, **changes) -> K3Model:
    """A seeded 2-layer K3 (a KDA and an MLA layer, the second FFN a quantile-balanced MoE unless changed)."""
    torch.manual_seed(seed)
    cfg = K3Config.preset("tiny").replace(n_layers=2, d_model=64, kda_per_mla=1, **changes)
    return K3Model.from_config(cfg)


def _step_cases() -> list[Case]:
    """A model, its AdamW and warmup + cosine scheduler after one step (Adam's moments are filled, and torch
    does not warn about a copied scheduler's first step), A micro-batches [B, T] of random bytes, a clip."""
    g = torch.Generator().manual_seed(1201)
    cases = []
    for name, (n_micro, grad_clip, changes) in {
            "one micro-batch, a clip above the norm": (1, 100.0, {}),
            "two micro-batches: the mean of their losses": (2, 1.0, {}),
            "three micro-batches, a clip that bites": (3, 0.5, {}),
            "the sign rule": (2, 0.5, {"balancing": "sign"}),
            "no MoE layer (every FFN dense)": (2, 0.05, {"first_k_dense": 2})}.items():
        model = _small_model(1202 + len(cases), **changes)
        optimizer, scheduler = make_optimizer(model, TrainConfig(steps=10, warmup_steps=3, lr=3e-3))
        first, second = ([tuple(torch.randint(0, 256, (2, 2, 12), generator=g)) for _ in range(n_micro)]
                         for _ in range(2))
        train_step(model, optimizer, scheduler, first, grad_clip)  # the graded step is the second
        for moe in model.moe_layers():  # the first step's losses, off their spent graph (for deepcopy)
            moe.aux_loss, moe.z_loss = moe.aux_loss.detach(), moe.z_loss.detach()
        cases.append(Case(name, (model, optimizer, scheduler, second, grad_clip)))
    return cases


def bits_per_byte(model: K3Model, windows: torch.Tensor, batch_size: int) -> float:
    """The package's validation number (:func:`k3course.train.evaluate`, nats per predicted byte over all the
    windows [N, T + 1], in batches of ``batch_size``) in bits: / ln 2."""
    return evaluate(model, windows, batch_size) / LN2


def _eval_cases() -> list[Case]:
    """A seeded model whose head is scaled up (the losses of its windows differ by nats, so how the mean is taken
    shows), and windows of random bytes."""
    g = torch.Generator().manual_seed(1203)
    model = _small_model(1204)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    cases = []
    for name, (n, length, batch_size) in {"one batch": (4, 9, 4), "7 windows in batches of 3 (the last holds 1)":
                                          (7, 9, 3), "5 windows in batches of 4": (5, 17, 4),
                                          "batches of 1": (3, 6, 1)}.items():
        cases.append(Case(name, (model, torch.randint(0, 256, (n, length), generator=g), batch_size)))
    return cases


register(Exercise("12.lr_factor", lr_factor, _schedule_cases))
register(Exercise("12.ngram_bits_per_byte", ngram_bits_per_byte, _ngram_cases))
register(Exercise("12.train_step", train_step, _step_cases, tolerance={"float64": (1e-5, 1e-8)},
                  mutable=("model", "optimizer", "scheduler")))
register(Exercise("12.evaluate", bits_per_byte, _eval_cases, tolerance={"float64": (1e-5, 1e-8)}))
