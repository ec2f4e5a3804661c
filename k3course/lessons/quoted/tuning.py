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


def _choices(names: tuple[str, ...]) -> list[tuple[float, tuple[float, ...], tuple[float, ...], str]]:
    """(chosen rate, grid, every rate its tuning ran at, the rule that chose) of every tuned variant of the saved
    experiments ``names`` (claims and the controlled MQAR mixers alike)."""
    found = []
    for name in names:
        result = experiments.load(name)["result"]
        if "tuning" in result:
            tuned = result["tuning"]
            found += [(lr, tuple(tuned["grid"]), tuple(rule.rates_tried([tuned["trials"][label]])), tuned["rule"])
                      for label, lr in tuned["chosen"].items()]
        else:
            found += [(variant["lr"], tuple(variant["lr_grid"]), tuple(rule.rates_tried([variant["trials"]])),
                       result["rule"]) for variant in result["variants"].values() if "lr_grid" in variant]
    return found


@quoted
def edge_choices(*names: str) -> str:
    """``edge/all``: how many tuned variants of the saved experiments ``names`` chose the smallest or the largest rate
    their tuning ran at (the grid's, or the run past its edge): a rate whose best may lie further out."""
    found = _choices(names)
    return f"{sum(lr in (min(tried), max(tried)) for lr, _, tried, _ in found)}/{len(found)}"


@quoted
def top_edge_choices(*names: str) -> str:
    """``top/all``: how many tuned variants of ``names`` chose the largest rate their tuning ran at."""
    found = _choices(names)
    return f"{sum(lr == max(tried) for lr, _, tried, _ in found)}/{len(found)}"


@quoted
def grid_edge_choices(*names: str) -> str:
    """``edge/all``: how many tuned variants of ``names`` had their lowest grid run at an edge of the grid, before
    any run past it (the variants the rule extends)."""
    found = _choices(names)
    return f"{sum(tuple(tried) != grid or lr in (grid[0], grid[-1]) for lr, grid, tried, _ in found)}/{len(found)}"


@quoted
def extensions_won(*names: str) -> str:
    """``won/extended``: of the tuned variants of ``names`` that ran once past the grid's edge, how many chose that
    rate."""
    extended = [(lr, grid, tried) for lr, grid, tried, _ in _choices(names) if tried != grid]
    return f"{sum(lr not in grid for lr, grid, _ in extended)}/{len(extended)}"


@quoted
def unextended(*names: str) -> str:
    """The saved experiments of ``names`` whose rates were chosen by the rule before it ran past an edge
    (:data:`~k3course.lessons.tuning.RULE_WITHOUT_EXTENSION`) although a variant chose an edge of the grid, as the
    lesson lists them ("none" if every one was re-run)."""
    left = [name for name in names if any(used == rule.RULE_WITHOUT_EXTENSION and lr in (grid[0], grid[-1])
                                          for lr, grid, _, used in _choices((name,)))]
    return ", ".join(left) or "none"


@quoted
def horizon_agreement(measure: str = "val_bpb") -> str:
    """``agree/all``: of the variants the tuning-horizon experiment trained at full length at every rate, how many
    ended lowest (``measure``: "val_bpb" or "tail_loss") at the rate the quarter-length tuning chose."""
    variants = experiments.load("tuning-horizon")["result"]["variants"].values()
    return f"{sum(v['chosen'] == v[f'lowest_{measure}'] for v in variants)}/{len(variants)}"


@quoted
def horizon_val_bpb(variant: str, lr: float) -> float:
    """Final validation bits/byte of ``variant``'s full-length seed-0 run at ``lr`` in the tuning-horizon
    experiment."""
    rows = experiments.load("tuning-horizon")["result"]["variants"][variant]["full"]
    found = {row["lr"]: row["val_bpb"] for row in rows}
    if lr not in found:
        raise KeyError(f"lr: tuning-horizon trained {variant!r} at {sorted(found)}, not at {lr!r}")
    return found[lr]


@quoted
def horizon_claim() -> str:
    """The saved claim the tuning-horizon experiment checks."""
    return experiments.load("tuning-horizon")["result"]["claim_result"]
