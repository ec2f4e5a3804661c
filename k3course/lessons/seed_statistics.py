"""Statistics over seeds of a saved experiment (chapter 12): each variant's spread, the paired comparison of two
variants seed by seed with the chapter's verdict rule, and their plots. A result is what
:mod:`k3course.lessons.experiments` saves: {"runs": [{"variant" (or "mixer"), "seed", metric: value, ...}, ...],
"variants": {label: description}}.
"""

from __future__ import annotations

import math

from k3course.guards import is_number


def spread(result: dict, metric: str, key: str = "variant") -> dict[str, dict]:
    """{variant: {"mean", "std", "min", "max", "n"}} of ``metric`` over the seeds of a result's runs, grouped by
    ``key`` ("variant", or "mixer" for mqar-mixers); std is the sample standard deviation (0 for one seed)."""
    values: dict[str, list[float]] = {}
    for run in result["runs"]:
        values.setdefault(run[key], []).append(run[metric])
    table = {}
    for label, xs in values.items():
        mean, std = _mean_std(xs)
        table[label] = {"mean": mean, "std": std, "min": min(xs), "max": max(xs), "n": len(xs)}
    return table


def spread_table(result: dict, metric: str, columns: tuple[str, ...] = (), key: str = "variant",
                 digits: int = 3) -> str:
    """A text table, one row per variant: the ``columns`` of its :func:`describe` entry, then ``metric`` as
    mean ± std [min, max] over its seeds (n seeds)."""
    table = spread(result, metric, key)
    shown = lambda value: f"{value:,}" if isinstance(value, int) else f"{value:.3g}" if isinstance(value, float) \
        else str(value)
    cells = {label: [shown(result["variants"][label][c]) for c in columns] for label in table}
    widths = [max(len(c), *(len(cells[label][i]) for label in table)) + 2 for i, c in enumerate(columns)]
    width = max(len(key), *(len(label) for label in table)) + 2
    rows = [f"{key:<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths))
            + f"   {metric}: mean ± std [min, max] (seeds)"]
    for label, s in table.items():
        rows.append(f"{label:<{width}}" + "".join(f"{v:>{w}}" for v, w in zip(cells[label], widths))
                    + f"   {s['mean']:.{digits}f} ± {s['std']:.{digits}f} [{s['min']:.{digits}f}, "
                    f"{s['max']:.{digits}f}] ({s['n']})")
    return "\n".join(rows)


CONFIDENCE = 0.95  # chapter 12's verdict rule: a two-sided 95% t-interval of the mean paired difference


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (0.5 < probability < 1), by
    bisection on its CDF, F(t) = 1 − I_{df/(df+t²)}(df/2, 1/2) / 2 (:func:`_incomplete_beta`): t₀.₉₇₅ is 12.706
    at df 1, 4.303 at 2, 2.776 at 4."""
    if not is_number(df) or df < 1:
        raise ValueError(f"df must be an int ≥ 1, got {df!r}")
    if not 0.5 < probability < 1:
        raise ValueError(f"probability must be in (0.5, 1), got {probability!r}")
    cdf = lambda t: 1 - 0.5 * _incomplete_beta(df / (df + t * t), df / 2, 0.5)
    low, high = 0.0, 1.0
    while cdf(high) < probability:
        low, high = high, 2 * high
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return (low + high) / 2


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (Lentz's method; for
    x > (a+1)/(a+b+2) through I_x(a, b) = 1 − I_{1−x}(b, a))."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    if x > (a + 1) / (a + b + 2):
        return 1 - _incomplete_beta(1 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return front * fraction


def verdict(differences: list[float], confidence: float = CONFIDENCE) -> dict:
    """Chapter 12's verdict rule, fixed before any claim was re-graded by it: the two-sided ``confidence``
    t-interval of the mean paired difference, mean ± t · s/√n (s the sample std of the n differences, t the
    (1 + confidence)/2 quantile of Student's t with n − 1 degrees of freedom). "reproduced" iff the whole interval
    lies above 0, "reversed" iff below 0, "undecided" otherwise (always with one seed: no interval).
    Returns {"mean", "std", "half_width", "interval": (low, high), "verdict"}."""
    n = len(differences)
    mean, std = _mean_std(differences)
    half_width = t_quantile((1 + confidence) / 2, n - 1) * std / n ** 0.5 if n > 1 else math.inf
    low, high = mean - half_width, mean + half_width
    word = "reproduced" if low > 0 else "reversed" if high < 0 else "undecided"
    return {"mean": mean, "std": std, "half_width": half_width, "interval": (low, high), "verdict": word}


def paired(result: dict, better: str, worse: str, metric: str = "val_bpb", key: str = "variant",
           higher_is_better: bool = False) -> dict:
    """The paired comparison of two variants of a result over their common seeds (one seed: the same
    initialisation draws and the same batches in both runs), graded by chapter 12's rule (:func:`verdict`).

    Per seed s, d_s = metric(worse, s) − metric(better, s) (better − worse when ``higher_is_better``), so d_s > 0
    means ``better`` won seed s. Returns {"differences": {seed: d_s}, "mean", "std" (sample std of d_s),
    "half_width", "interval" (the 95% t-interval of the mean), "agreeing" (seeds with d_s > 0), "seeds",
    "verdict"}.
    """
    by_seed = {label: {run["seed"]: run[metric] for run in result["runs"] if run[key] == label}
               for label in (better, worse)}
    for label, values in by_seed.items():
        if not values:
            raise ValueError(f"no runs of {label!r} in the result; its {key}s are "
                             f"{sorted({run[key] for run in result['runs']})}")
    seeds = sorted(set(by_seed[better]) & set(by_seed[worse]))
    if not seeds:
        raise ValueError(f"{better!r} and {worse!r} share no seed, so no paired difference exists")
    sign = -1.0 if higher_is_better else 1.0
    differences = {seed: sign * (by_seed[worse][seed] - by_seed[better][seed]) for seed in seeds}
    graded = verdict(list(differences.values()))
    return {"differences": differences, **graded, "agreeing": sum(d > 0 for d in differences.values()),
            "seeds": len(seeds)}


def last_steps_mean(result: dict, series: str = "max_violation", steps: int = 20) -> dict:
    """``result`` with one more metric per run, ``f"{series}_last{steps}"``: the mean of the last ``steps`` values
    of the run's per-step ``series`` (balancing's metric: the max-violation a rule holds at the end of its run), for
    :func:`spread` and :func:`paired`. A run without ``series`` raises ValueError naming it."""
    runs = []
    for run in result["runs"]:
        if len(run.get(series, ())) < steps:
            raise ValueError(f"series: run {run.get('variant', run.get('mixer'))!r}, seed {run['seed']} has fewer "
                             f"than {steps} values of {series!r}")
        runs.append({**run, f"{series}_last{steps}": sum(run[series][-steps:]) / steps})
    return {**result, "runs": runs}


def cpu_seconds(result: dict, name: str | None = None) -> float:
    """What saved result ``name`` cost to train: the sum of its runs' "seconds" (every run on one thread, so about
    its CPU time), over every cell of a sweep and every tuning run. A run copied from another result ("reused_from":
    "OTHER: label") is that result's cost; one copied from an earlier save of ``name`` itself is still this one's."""
    runs = result["runs"] if "runs" in result else [run for cell in result["cells"] for run in cell["runs"]]
    trials = [trial for trials in result.get("tuning", {}).get("trials", {}).values() for trial in trials]
    trained_for_it = lambda run: "reused_from" not in run or run["reused_from"].split(":")[0] == name
    return sum(run["seconds"] for run in runs + trials if trained_for_it(run))


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0


def plot_paired(axes, result: dict, comparisons: list[tuple[str, str]], metric: str = "val_bpb",
                key: str = "variant", higher_is_better: bool = False) -> None:
    """For each (better, worse) of ``comparisons``: every seed's paired difference d_s (:func:`paired`) as a dot,
    their mean as a bar with its 95% t-interval as whiskers, on matplotlib ``axes``; under each pair's name on the
    x axis, its verdict on a line of its own (outside the plot, so it meets neither the dots nor the title). A
    claim is reproduced when the whole interval sits above 0, reversed when below."""
    names = []
    for i, (better, worse) in enumerate(comparisons):
        comparison = paired(result, better, worse, metric, key, higher_is_better)
        low, high = comparison["interval"]
        axes.bar(i, comparison["mean"], width=0.5, color="lightsteelblue", label="mean paired difference"
                 if i == 0 else None)
        axes.errorbar(i, comparison["mean"], yerr=[[comparison["mean"] - low], [high - comparison["mean"]]],
                      color="0.35", capsize=6, lw=1.2, label="95% t-interval of the mean" if i == 0 else None)
        differences = list(comparison["differences"].values())
        axes.plot([i] * len(differences), differences, "k.", ms=6, label="one seed" if i == 0 else None)
        names.append(f"{better}\nvs {worse}\n→ {comparison['verdict']}")
    axes.axhline(0, color="k", lw=0.8)
    axes.set_xticks(range(len(comparisons)), names, fontsize=8)
    axes.set_ylabel(f"paired {metric} difference ({'better − worse' if higher_is_better else 'worse − better'})")


def plot_spread(axes, result: dict, metric: str, key: str = "variant") -> None:
    """Each variant's seeds as dots, their mean as a bar and their range (min to max) as whiskers, on matplotlib
    ``axes``. The whiskers span the seeds themselves, so they never leave the metric's range (an accuracy's
    mean + std can pass 1; its best seed cannot); the tables print mean ± std."""
    table = spread(result, metric, key)
    labels = list(table)
    means = [table[v]["mean"] for v in labels]
    whiskers = [[m - table[v]["min"] for v, m in zip(labels, means)],
                [table[v]["max"] - m for v, m in zip(labels, means)]]
    axes.bar(range(len(labels)), means, yerr=whiskers, color="lightsteelblue", capsize=4,
             label="mean; whiskers: min to max")
    for i, label in enumerate(labels):
        seeds = [run[metric] for run in result["runs"] if run[key] == label]
        axes.plot([i] * len(seeds), seeds, "k.", ms=5, label="one seed" if i == 0 else None)
    axes.set_xticks(range(len(labels)), labels, rotation=15)
    low = min(table[v]["min"] for v in labels)
    high = max(table[v]["max"] for v in labels)
    axes.set_ylim(low - 0.3 * (high - low + 1e-9), high + 0.3 * (high - low + 1e-9))
    axes.set_ylabel(metric)
