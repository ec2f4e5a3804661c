"""Chapter 05: recall without training. Each function is a number a lesson quotes
(see :mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

from k3course.lessons.quoted.markers import quoted

PAIR_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 48)  # lesson 05's table


@quoted
def pair_recall(rule: str, n_pairs: int, beta: float = 1.0) -> float:
    """Lesson 05's recall error after writing ``n_pairs`` pairs (``decay_tasks.pair_recall_error``)."""
    from k3course.lessons.decay_tasks import pair_recall_error

    return pair_recall_error(rule, n_pairs, beta=beta)


@quoted
def pair_recall_best_from(beta: float = 0.5) -> int:
    """The pair count of lesson 05's table from which the delta rule with step ``beta`` has the lowest error of the
    three rules at every larger count."""
    def best(n: int) -> bool:
        mine = pair_recall("delta rule", n, beta)
        return mine < min(pair_recall("linear attention", n), pair_recall("delta rule", n))

    return next(n for i, n in enumerate(PAIR_COUNTS) if all(best(m) for m in PAIR_COUNTS[i:]))
