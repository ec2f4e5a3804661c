"""Chapter 12 (train and validate): the warmup + cosine learning-rate factor, an add-k byte n-gram baseline, one
optimizer step (accumulation, clipping, the balancing-bias update) and the validation number in bits per byte."""

from __future__ import annotations

import copy

import numpy as np
import torch

from k3course.config import K3Config
from k3course.data import IGNORE, ngram_bits_per_byte
from k3course.grading.registry import Case, Exercise, register
from k3course.model import K3Model
from k3course.train import TrainConfig
from k3course.train.step import LN2, evaluate, lr_factor, make_optimizer, train_step


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


def _micro_batches(g: torch.Generator, sizes: tuple[int, ...], ignored: bool) -> list[tuple]:
    """One (inputs, targets) pair [b, 12] of random bytes per size b; ``ignored``: targets -100 at random, more in
    the later micro-batches (so micro-batches count different numbers of targets)."""
    batches = []
    for j, size in enumerate(sizes):
        inputs, targets = torch.randint(0, 256, (2, size, 12), generator=g)
        if ignored:
            targets = targets.masked_fill(torch.rand(size, 12, generator=g) < 0.2 + 0.3 * j, IGNORE)
        batches.append((inputs, targets))
    return batches


def _step_cases() -> list[Case]:
    """A model, its AdamW and warmup + cosine scheduler after one step (Adam's moments are filled, and torch
    does not warn about a copied scheduler's first step), micro-batches of random bytes, a clip."""
    g = torch.Generator().manual_seed(1201)
    cases = []
    for name, (sizes, grad_clip, changes, ignored, handed_in_eval) in {
            "one micro-batch, a clip above the norm": ((2,), 100.0, {}, False, False),
            "two micro-batches: the mean of their losses": ((2, 2), 1.0, {}, False, False),
            "three micro-batches, a clip that bites": ((2, 2, 2), 0.5, {}, False, False),
            "the sign rule": ((2, 2), 0.5, {"balancing": "sign"}, False, False),
            "no MoE layer (every FFN dense)": ((2, 2), 0.05, {"first_k_dense": 2}, False, False),
            "a model handed in eval mode (it trains in training mode)": ((2, 2), 1.0, {}, False, True),
            "unequal micro-batches (1 and 3 sequences): the mean over every byte": ((1, 3), 100.0, {}, False, False),
            "ignored (-100) targets, more in the second micro-batch": ((2, 2), 100.0, {}, True, False)}.items():
        model = _small_model(1202 + len(cases), **changes)
        optimizer, scheduler = make_optimizer(model, TrainConfig(steps=10, warmup_steps=3, lr=3e-3))
        first = _micro_batches(g, (2,) * len(sizes), False)
        train_step(model, optimizer, scheduler, first, grad_clip)  # the graded step is the second
        for moe in model.moe_layers():  # the first step's losses, off their spent graph (for deepcopy)
            moe.aux_loss, moe.z_loss = moe.aux_loss.detach(), moe.z_loss.detach()
        model.train(not handed_in_eval)
        cases.append(Case(name, (model, optimizer, scheduler, _micro_batches(g, sizes, ignored), grad_clip)))
    return cases


def stepped_and_the_gradients_left(answer, model: K3Model, optimizer, scheduler, micro_batches, grad_clip) -> dict:
    """``answer``'s step report, and how many parameters still hold a ``.grad`` after it (none: the step's
    gradients must not leak into whatever runs backward next)."""
    report = answer(model, optimizer, scheduler, micro_batches, grad_clip)
    left = sum(parameter.grad is not None for parameter in model.parameters())
    return {"the step's report": report, "parameters with a gradient left in .grad": left}


def bits_per_byte(model: K3Model, windows: torch.Tensor, batch_size: int) -> float:
    """The package's validation number (:func:`k3course.train.step.evaluate`, nats per predicted byte over all the
    windows [N, T + 1], in batches of ``batch_size``, in eval mode, the caller's mode restored) in bits: / ln 2."""
    return evaluate(model, windows, batch_size) / LN2


def evaluated_and_the_mode_after(answer, model: K3Model, windows: torch.Tensor, batch_size: int) -> dict:
    """``answer``'s bits per byte, and whether the model is in training mode after it (the caller's mode)."""
    bits = answer(model, windows, batch_size)
    return {"bits per byte": bits, "the model is in training mode after the call": model.training}


def _eval_cases() -> list[Case]:
    """A seeded model whose head is scaled up (the losses of its windows differ by nats, so how the mean is taken
    shows), in training mode, and windows of random bytes; then an aux-loss-balanced model (its auxiliary loss is
    in the model's training loss, never in a validation number) and a model handed in eval mode."""
    g = torch.Generator().manual_seed(1203)
    model, aux_balanced = _small_model(1204), _small_model(1205, balancing="aux_loss")
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    cases = []
    for name, (n, length, batch_size, handed) in {
            "one batch": (4, 9, 4, model),
            "7 windows in batches of 3 (the last holds 1)": (7, 9, 3, model),
            "5 windows in batches of 4": (5, 17, 4, model), "batches of 1": (3, 6, 1, model),
            "an aux-loss-balanced model handed in training mode": (4, 9, 2, aux_balanced),
            "a model handed in eval mode stays in eval mode": (4, 9, 2, copy.deepcopy(model).eval())}.items():
        cases.append(Case(name, (handed, torch.randint(0, 256, (n, length), generator=g), batch_size)))
    return cases


register(Exercise("12.lr_factor", lr_factor, _schedule_cases))
register(Exercise("12.ngram_bits_per_byte", ngram_bits_per_byte, _ngram_cases))
register(Exercise("12.train_step", train_step, _step_cases, tolerance={"float64": (1e-5, 1e-8)},
                  mutable=("model", "optimizer", "scheduler"), harness=stepped_and_the_gradients_left))
register(Exercise("12.evaluate", bits_per_byte, _eval_cases, tolerance={"float64": (1e-5, 1e-8)},
                  harness=evaluated_and_the_mode_after, package=(evaluate,)))
