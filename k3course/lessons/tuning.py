"""Tuned alike: every variant of a comparison trains at its own best learning rate from one shared grid, chosen by
one rule fixed before any run (chapter 12).

The rule: train each variant once, at seed 0, for a quarter of the comparison's steps (its warmup a quarter too,
the schedule over those steps, the same batch shape) at every rate of the grid; its rate is the one whose run
ends lowest — the mean training loss over the last tenth of the tuning run (:func:`tail_loss`), a diverged run
(a non-finite loss) counting as +∞, ties going to the smaller rate. If that rate is the grid's smallest or largest,
its best may lie outside the grid: one more tuning run, one grid step further out (:func:`extension`: 3e-4 below
1e-3, 3e-2 above 1e-2), and the rate is chosen again over the grid and that run. Then every seed trains at the full
budget with that rate. Training loss on batches never seen before estimates the validation loss without spending
evaluation bytes, and it serves both tasks (text and MQAR) alike.
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
        "as +inf; ties: the smaller rate); a rate at the grid's edge: one more run one grid step past it, and the "
        "choice made again over all the runs")
# The rule before issue 50 (no run past an edge): the saved results it made say so in their "rule".
RULE_WITHOUT_EXTENSION = RULE.split("; a rate at the grid's edge")[0]


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


def grid_step(grid: tuple[float, ...]) -> float:
    """The grid's ratio between neighbouring rates, (largest / smallest)^(1 / (n − 1)): √10 ≈ 3.16 for 1e-3 … 1e-2."""
    return (grid[-1] / grid[0]) ** (1 / (len(grid) - 1))


def extension(grid: tuple[float, ...], trials: dict[float, list[float]]) -> float | None:
    """The one rate the rule tries past the sorted ``grid`` after its ``trials`` {lr: losses}: when
    :func:`choose_lr` picks the largest rate, that rate × :func:`grid_step`; the smallest, ÷ it; rounded to one
    significant figure (1e-2 → 3e-2, 1e-3 → 3e-4). None for a rate inside the grid."""
    chosen = choose_lr(trials)
    if chosen not in (grid[0], grid[-1]):
        return None
    step = grid_step(grid) if chosen == grid[-1] else 1 / grid_step(grid)
    return float(f"{chosen * step:.0e}")


def check_grid(grid) -> tuple[float, ...]:
    """``grid`` as a sorted tuple of distinct positive rates, at least 3 of them (ValueError otherwise)."""
    rates = tuple(sorted(set(grid))) if isinstance(grid, list | tuple) else ()
    if len(rates) < 3 or not all(is_number(r, int | float) and r > 0 for r in rates):
        raise ValueError(f"lr_grid must hold at least 3 distinct positive learning rates, got {grid!r}")
    return tuple(float(r) for r in rates)


def rates_tried(trials_by_variant) -> list[float]:
    """Every rate some variant's tuning ran at, sorted: the grid and the runs past its edges. ``trials_by_variant``:
    lists of {"lr", ...} trials, one list per variant."""
    return sorted({trial["lr"] for trials in trials_by_variant for trial in trials})


def trial_cells(trials: list[dict], rates: list[float], chosen: float, width: int) -> str:
    """One variant's tail losses under the columns ``rates`` (``width`` characters each), the ``chosen`` rate's
    starred, a rate it never ran at blank."""
    tails = {trial["lr"]: trial["tail_loss"] for trial in trials}
    return "".join(f"{'':>{width}}" if lr not in tails else
                   f"{tails[lr]:>{width - 1}.3f}" + ("*" if lr == chosen else " ") for lr in rates)


def tuning_table(result: dict) -> str:
    """A tuned result's trials as text: one row per variant, each rate's tail loss (:func:`tail_loss`; blank where
    the variant never ran: the run past the grid's edge is only for an edge winner), the chosen rate marked with *,
    then the rate every seed trained at."""
    tuned = result["tuning"]
    rates = rates_tried(tuned["trials"].values())
    rows = [f"{'variant':<30}" + "".join(f"{f'lr {lr:g}':>12}" for lr in rates) + "   chosen"]
    for label, trials in tuned["trials"].items():
        rows.append(f"{label:<30}" + trial_cells(trials, rates, tuned["chosen"][label], 12)
                    + f"   {tuned['chosen'][label]:g}")
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
    rates = rates_tried(tuned["trials"].values())
    axes.set_xticks(rates, [f"{lr:g}" for lr in rates])
    axes.minorticks_off()
