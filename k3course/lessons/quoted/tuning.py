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


def _choices(names: tuple[str, ...]) -> list[tuple[float, tuple[float, ...]]]:
    """(chosen rate, grid) of every tuned variant of the saved experiments ``names`` (claims and the controlled
    MQAR mixers alike)."""
    found = []
    for name in names:
        result = experiments.load(name)["result"]
        if "tuning" in result:
            grid = tuple(result["tuning"]["grid"])
            found += [(lr, grid) for lr in result["tuning"]["chosen"].values()]
        else:
            found += [(variant["lr"], tuple(variant["lr_grid"])) for variant in result["variants"].values()
                      if "lr_grid" in variant]
    return found


@quoted
def edge_choices(*names: str) -> str:
    """``edge/all``: how many tuned variants of the saved experiments ``names`` chose the smallest or the largest rate
    of their grid (an edge winner: its best rate may lie outside the grid)."""
    found = _choices(names)
    return f"{sum(lr in (min(grid), max(grid)) for lr, grid in found)}/{len(found)}"


@quoted
def top_edge_choices(*names: str) -> str:
    """``top/all``: how many tuned variants of ``names`` chose the largest rate of their grid."""
    found = _choices(names)
    return f"{sum(lr == max(grid) for lr, grid in found)}/{len(found)}"
