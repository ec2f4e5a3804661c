"""Chapter 12: how the claims' variants were tuned alike (:mod:`k3course.lessons.tuning`). Each function is a number
a lesson quotes (see :mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

from k3course.lessons import experiments
from k3course.lessons import tuning as rule
from k3course.lessons.quoted.markers import quoted


@quoted
def lr_grid() -> str:
    """The shared learning-rate grid, written as the lesson lists it: "0.001, 0.003, 0.01"."""
    return ", ".join(f"{lr:g}" for lr in rule.LR_GRID)


@quoted
def claim_lr(name: str, variant: str) -> float:
    """The learning rate a saved claim's variant trained every seed at (its tuning's choice)."""
    return experiments.load(name)["result"]["training"][variant]["lr"]


@quoted
def tuning_steps(name: str) -> int:
    """Steps of a saved claim's tuning runs (a quarter of its runs' steps)."""
    return experiments.load(name)["result"]["tuning"]["settings"]["steps"]


@quoted
def claim_tuning_loss(name: str, variant: str, lr: float) -> float:
    """The tail loss (:func:`k3course.lessons.tuning.tail_loss`) of a saved claim's tuning run of ``variant`` at
    rate ``lr``."""
    tuned = experiments.load(name)["result"]["tuning"]["trials"][variant]
    trials = {trial["lr"]: trial["tail_loss"] for trial in tuned}
    if lr not in trials:
        raise KeyError(f"lr: {name}'s {variant!r} was tuned at {sorted(trials)}, not at {lr!r}")
    return trials[lr]
