"""Tuned alike: every variant of a comparison trains at its own best learning rate from one shared grid, chosen by
one rule fixed before any run (chapter 12).

The rule: train each variant once, at seed 0, for a quarter of the comparison's steps (its warmup a quarter too,
the schedule over those steps, the same batch shape) at every rate of the grid; its rate is the one whose run
ends lowest — the mean training loss over the last tenth of the tuning run (:func:`tail_loss`), a diverged run
(a non-finite loss) counting as +∞, ties going to the smaller rate. Then every seed trains at the full budget with
that rate. Training loss on batches never seen before estimates the validation loss without spending evaluation
bytes, and it serves both tasks (text and MQAR) alike.
"""

from __future__ import annotations

import math

from k3course.guards import is_number
from k3course.train import TrainConfig

LR_GRID = (1e-3, 3e-3, 1e-2)  # one factor of about 3 either side of the course's default 3e-3
TUNING_SEED = 0
TUNING_FRACTION = 4  # the tuning run takes 1/4 of the comparison's steps
TAIL = 0.1  # the rule reads the mean loss over the last tenth of the tuning run
RULE = ("each variant at seed 0 for a quarter of the steps (warmup and schedule scaled alike) at every rate of the "
        "grid; its rate: the lowest mean training loss over the last tenth of that run (a non-finite loss counts "
        "as +inf; ties: the smaller rate)")


def tuning_settings(train: TrainConfig) -> TrainConfig:
    """The tuning run of a comparison trained with ``train``: steps // 4 (at least 1), warmup // 4, seed 0."""
    return train.replace(steps=max(1, train.steps // TUNING_FRACTION),
                         warmup_steps=train.warmup_steps // TUNING_FRACTION, seed=TUNING_SEED)


def tail_loss(losses: list[float]) -> float:
    """Mean of the last ⌈len/10⌉ losses; +inf if any of them (or any earlier loss) is not finite (a diverged run
    does not recover to win the rule)."""
    if not losses:
        raise ValueError("losses must hold at least one step's loss, got an empty list")
    if not all(math.isfinite(loss) for loss in losses):
        return math.inf
    tail = losses[-max(1, math.ceil(len(losses) * TAIL)):]
    return sum(tail) / len(tail)


def choose_lr(trials: dict[float, list[float]]) -> float:
    """The rate of ``trials`` {lr: per-step losses of its tuning run} whose :func:`tail_loss` is lowest (ties: the
    smaller rate); ValueError if every run diverged."""
    if not trials:
        raise ValueError("trials must hold at least one learning rate's run, got none")
    scored = sorted((tail_loss(losses), lr) for lr, losses in trials.items())
    best, lr = scored[0]
    if math.isinf(best):
        raise ValueError(f"trials: every run diverged (rates {sorted(trials)}); widen the grid downwards")
    return lr


def check_grid(grid) -> tuple[float, ...]:
    """``grid`` as a sorted tuple of distinct positive rates, at least 3 of them (ValueError otherwise)."""
    rates = tuple(sorted(set(grid))) if isinstance(grid, list | tuple) else ()
    if len(rates) < 3 or not all(is_number(r, int | float) and r > 0 for r in rates):
        raise ValueError(f"lr_grid must hold at least 3 distinct positive learning rates, got {grid!r}")
    return tuple(float(r) for r in rates)


def tuning_table(result: dict) -> str:
    """A tuned result's trials as text: one row per variant, each rate's tail loss (:func:`tail_loss`), the chosen
    rate marked with *, then the rate every seed trained at."""
    tuned = result["tuning"]
    rows = [f"{'variant':<30}" + "".join(f"{f'lr {lr:g}':>12}" for lr in tuned["grid"]) + "   chosen"]
    for label, trials in tuned["trials"].items():
        cells = [f"{trial['tail_loss']:.3f}" + ("*" if trial["lr"] == tuned["chosen"][label] else " ")
                 for trial in trials]
        rows.append(f"{label:<30}" + "".join(f"{cell:>12}" for cell in cells) + f"   {tuned['chosen'][label]:g}")
    return "\n".join(rows)


def plot_tuning(axes, result: dict) -> None:
    """Each variant's tail loss against the learning rate of its tuning runs (log x), the chosen rate circled, on
    matplotlib ``axes``: where the curves bottom out is where each variant trains."""
    tuned = result["tuning"]
    for label, trials in tuned["trials"].items():
        rates = [trial["lr"] for trial in trials]
        line, = axes.plot(rates, [trial["tail_loss"] for trial in trials], "o-", ms=4, label=label)
        chosen = next(trial for trial in trials if trial["lr"] == tuned["chosen"][label])
        axes.plot(chosen["lr"], chosen["tail_loss"], "o", ms=11, mfc="none", color=line.get_color())
    axes.set(xscale="log", xlabel="learning rate", ylabel="mean training loss, last tenth of the tuning run")
    axes.set_xticks(tuned["grid"], [f"{lr:g}" for lr in tuned["grid"]])
    axes.minorticks_off()
