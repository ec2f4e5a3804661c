"""The one training loop of the lessons' experiments: :func:`fit`, on the package's schedule by default.

    for step s = 0, 1, …, S − 1:   loss = loss_at(s);  zero the gradients;  loss.backward();  optimizer.step()
                                   schedule.step();  after_step(s)

The schedule (:func:`schedule`) is the package's (:func:`k3course.train.step.lr_factor`: linear warmup over W
steps, cosine to ``min_lr_ratio`` · lr at S) unless an experiment names another: "one_cycle" (``OneCycleLR``,
10 % warmup; the decay and recall tasks of chapters 04–06 were run and saved with it) or "constant" (the
residual and balancing comparisons of chapters 10 and 13). ``k3course train`` runs the package's own loop
(:mod:`k3course.train`); these experiments train small models of their own with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3course.data import IGNORE
from k3course.guards import is_number
from k3course.train.step import lr_factor as package_lr_factor

SCHEDULES = ("warmup_cosine", "one_cycle", "constant")


def schedule(optimizer: torch.optim.Optimizer, steps: int, kind: str = "warmup_cosine", warmup_steps: int = 0,
             min_lr_ratio: float = 0.1, lr_factor: Callable = package_lr_factor):
    """The learning-rate schedule of a ``steps``-step run (None for "constant"): "warmup_cosine", each group's
    lr · ``lr_factor(step, warmup_steps, steps, min_lr_ratio)`` (the package's, or yours); "one_cycle",
    ``OneCycleLR`` up to each group's lr over the first 10 % of the steps, then down (its momentum cycled too)."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    if kind == "constant":
        return None
    if kind == "one_cycle":
        peaks = [group["lr"] for group in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peaks, total_steps=steps, pct_start=0.1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps, steps,
                                                                               min_lr_ratio))


def fit(optimizer: torch.optim.Optimizer, steps: int, loss_at: Callable[[int], torch.Tensor], *,
        schedule_kind: str = "warmup_cosine", warmup_steps: int = 0, min_lr_ratio: float = 0.1,
        stop_after: int | None = None, every: int = 0, at_every: Callable[[int], None] | None = None,
        after_step: Callable[[int], None] | None = None) -> list[float]:
    """Train ``steps`` optimizer steps on ``loss_at(step)`` (a scalar tensor) on :func:`schedule` of
    ``schedule_kind``; returns the per-step losses (floats). ``stop_after`` ends the run early without changing
    any earlier step (the schedule is the whole run's); ``at_every(step)`` runs before each step that ``every``
    divides (e.g. a held-out evaluation); ``after_step(step)`` after each optimizer step (e.g. a bias update)."""
    if not is_number(steps) or steps < 1:
        raise ValueError(f"steps must be an int ≥ 1, got {steps!r}")
    if stop_after is not None and not 1 <= stop_after <= steps:
        raise ValueError(f"stop_after must be None or in [1, steps = {steps}], got {stop_after!r}")
    scheduler = schedule(optimizer, steps, schedule_kind, warmup_steps, min_lr_ratio)
    losses = []
    for step in range(steps if stop_after is None else stop_after):
        if every and at_every is not None and step % every == 0:
            at_every(step)
        loss = loss_at(step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if after_step is not None:
            after_step(step)
        losses.append(loss.item())
    return losses


def cross_entropy_at(model: torch.nn.Module, batch_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
                     ) -> Callable[[int], torch.Tensor]:
    """step -> the token cross-entropy of ``model`` on ``batch_at(step) -> (tokens [B, T], targets [B, T])``
    (targets = IGNORE are skipped): :func:`fit`'s ``loss_at`` for a language model."""
    def loss_at(step: int) -> torch.Tensor:
        tokens, targets = batch_at(step)
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    return loss_at
