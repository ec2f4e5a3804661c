"""Chapter 12 §6.3: MQAR, controlled — the mixers started alike and tuned alike (``mqar-controlled``, its 8-channel
twin ``mqar-controlled-8``), and the untuned sweep they start from (``mqar-sweep``); the depth experiment
(``mqar-depth``) is a claim, quoted by :mod:`k3course.lessons.quoted.claims`.
Each function is a number a lesson quotes (see :mod:`k3course.lessons.quoted`); every ``name`` is one of those
saved experiments, every ``variant`` one of its labels."""

from __future__ import annotations

import functools

from k3course.lessons import experiments, seed_statistics
from k3course.lessons.quoted.markers import Pair, plus_minus, quoted, span


@functools.cache
def _saved(name: str) -> dict:
    return experiments.load(name)


def _variant(name: str, variant: str) -> dict:
    variants = _saved(name)["result"]["variants"]
    if variant not in variants:
        raise KeyError(f"variant: {name} has no {variant!r}; its variants are {list(variants)}")
    return variants[variant]


def _paired(name: str, better: str, worse: str) -> dict:
    """:func:`k3course.lessons.seed_statistics.paired` on held-out accuracy (higher is better)."""
    return seed_statistics.paired(_saved(name)["result"], better, worse, metric="accuracy", key="variant",
                                  higher_is_better=True)


@quoted
def mqar_lr(name: str, variant: str) -> float:
    """The learning rate the tuning rule chose for ``variant``."""
    return _variant(name, variant)["lr"]


@quoted
def mqar_accuracy(name: str, variant: str) -> Pair:
    """Held-out recall accuracy of ``variant``: mean ± sample std over its seeds."""
    row = seed_statistics.spread(_saved(name)["result"], "accuracy")[variant]
    return plus_minus(row["mean"], row["std"])


@quoted
def mqar_paired_mean(name: str, better: str, worse: str) -> Pair:
    """Mean ± sample std over the seeds of accuracy(``better``) − accuracy(``worse``), seed by seed."""
    comparison = _paired(name, better, worse)
    return plus_minus(comparison["mean"], comparison["std"])


@quoted
def mqar_agreeing(name: str, better: str, worse: str) -> str:
    """``agreeing/seeds``: the seeds in which ``better`` recalled more than ``worse``."""
    comparison = _paired(name, better, worse)
    return f"{comparison['agreeing']}/{comparison['seeds']}"


@quoted
def mqar_interval(name: str, better: str, worse: str) -> Pair:
    """The 95% t-interval of the mean paired accuracy difference (low–high), chapter 12's verdict rule."""
    return span(*_paired(name, better, worse)["interval"])


@quoted
def mqar_verdict(name: str, better: str, worse: str) -> str:
    """"reproduced", "reversed" or "undecided" for "``better`` recalls more than ``worse``" (chapter 12's rule)."""
    return _paired(name, better, worse)["verdict"]


@quoted
def mqar_starting_decay(name: str, variant: str, head: int, end: str = "min") -> float:
    """−g at z = 0 that ``variant``'s head ``head`` starts from (first layer): the "min" or "max" over its
    channels."""
    low, high = _variant(name, variant)["starting_decays"][head]
    return {"min": low, "max": high}[end]


@quoted
def mqar_recall_of_pairs(name: str, variant: str, which: str, count: int) -> float:
    """Held-out recall of the ``count`` "oldest" or "newest" pairs written (by write order,
    ``accuracy_by_pair``), averaged over those pairs and ``variant``'s seeds."""
    if which not in ("oldest", "newest"):
        raise ValueError(f"which must be 'oldest' or 'newest', got {which!r}")
    _variant(name, variant)
    rows = [run["accuracy_by_pair"] for run in _saved(name)["result"]["runs"] if run["variant"] == variant]
    chosen = [row[:count] if which == "oldest" else row[-count:] for row in rows]
    return sum(map(sum, chosen)) / (count * len(chosen))


@quoted
def mqar_loss(name: str, variant: str, first: int, last: int) -> float:
    """``variant``'s mean training loss (nats) over steps ``first`` ≤ step < ``last``, averaged over its seeds."""
    _variant(name, variant)
    spans = [run["losses"][first:last] for run in _saved(name)["result"]["runs"] if run["variant"] == variant]
    if not all(spans) or any(len(losses) != last - first for losses in spans):
        raise ValueError(f"first, last: steps {first}..{last} are not all inside {name}'s runs")
    return sum(map(sum, spans)) / ((last - first) * len(spans))


@quoted
def mqar_sweep_accuracy(steps: int, n_pairs: int, head_dim: int, mixer: str, seed: int = 0) -> float:
    """Held-out recall of ``mixer`` at ``seed`` in the saved MQAR sweep's cell (``steps``, ``n_pairs``,
    ``head_dim``): the untuned numbers the controlled experiments start from."""
    for cell in _saved("mqar-sweep")["result"]["cells"]:
        if (cell["steps"], cell["n_pairs"], cell["head_dim"]) == (steps, n_pairs, head_dim):
            return next(run["accuracy"] for run in cell["runs"] if (run["mixer"], run["seed"]) == (mixer, seed))
    raise KeyError(f"the saved MQAR sweep tried no cell of {steps} steps, {n_pairs} pairs, {head_dim} channels")
