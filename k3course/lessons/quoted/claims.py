"""Chapter 12: the saved experiments behind the claims, and the saved training-step benchmark. Each function is a number
a lesson quotes (see :mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

import functools
import json

from k3course.lessons import experiments, seed_statistics
from k3course.lessons.quoted.markers import Pair, plus_minus, quoted, span


@functools.cache
def _saved(name: str) -> dict:
    return experiments.load(name)


# the claims whose per-run metrics include the max-violation over the last 20 steps ("max_violation_last20")
_LATE_VIOLATION = ("balancing", "expert-count")


@functools.cache
def _result(name: str) -> dict:
    """A saved claim's result as its verdicts read it: the MQAR sweep's chosen cell (runs keyed by "mixer"); the
    balancing claims with each run's max-violation averaged over its last 20 steps ("max_violation_last20")."""
    result = _saved(name)["result"]
    if name == "mqar-sweep":
        return experiments.sweep_comparison(result)
    return seed_statistics.last_steps_mean(result, "max_violation", 20) if name in _LATE_VIOLATION else result


def _key(name: str) -> str:
    return "mixer" if name == "mqar-sweep" else "variant"


def _values(name: str, variant: str, metric: str) -> list[float]:
    result = _result(name)
    values = [run[metric] for run in result["runs"] if run[_key(name)] == variant]
    if not values:
        raise KeyError(f"{name} has no runs of {variant!r}")
    return values


@quoted
def claim(name: str, variant: str, metric: str = "val_bpb") -> Pair:
    """mean ± sample std over the seeds of a saved claim's variant (``seed_statistics.spread``)."""
    row = seed_statistics.spread(_result(name), metric, _key(name))[variant]
    return plus_minus(row["mean"], row["std"])


@quoted
def claim_stat(name: str, variant: str, metric: str, stat: str) -> float:
    """One of "mean", "std", "min", "max" over the seeds of a saved claim's variant."""
    return seed_statistics.spread(_result(name), metric, _key(name))[variant][stat]


@quoted
def claim_range(name: str, variant: str, metric: str = "val_bpb") -> Pair:
    """min–max over the seeds of a saved claim's variant."""
    values = _values(name, variant, metric)
    return span(min(values), max(values))


def _paired(name: str, better: str, worse: str, metric: str) -> dict:
    """:func:`k3course.lessons.seed_statistics.paired` of a saved claim (accuracy: higher is better)."""
    return seed_statistics.paired(_result(name), better, worse, metric, _key(name),
                              higher_is_better=metric == "accuracy")


@quoted
def claim_paired(name: str, better: str, worse: str, metric: str = "val_bpb") -> Pair:
    """min–max over the seeds of the paired difference of a saved claim (``worse`` − ``better``; for accuracy
    ``better`` − ``worse``)."""
    differences = _paired(name, better, worse, metric)["differences"].values()
    return span(min(differences), max(differences))


@quoted
def claim_paired_mean(name: str, better: str, worse: str, metric: str = "val_bpb") -> Pair:
    """Mean ± sample std over the seeds of the paired difference of a saved claim."""
    comparison = _paired(name, better, worse, metric)
    return plus_minus(comparison["mean"], comparison["std"])


@quoted
def claim_interval(name: str, better: str, worse: str, metric: str = "val_bpb") -> Pair:
    """The 95% t-interval of the mean paired difference of a saved claim (low–high): chapter 12's verdict rule
    calls the claim reproduced when it lies above 0, reversed when below (:func:`seed_statistics.verdict`)."""
    return span(*_paired(name, better, worse, metric)["interval"])


@quoted
def claim_agreeing_seeds(name: str, better: str, worse: str, metric: str = "val_bpb") -> str:
    """``agreeing/seeds``: the seeds in which ``better`` beat ``worse``."""
    comparison = _paired(name, better, worse, metric)
    return f"{comparison['agreeing']}/{comparison['seeds']}"


@quoted
def claim_verdict(name: str, better: str, worse: str, metric: str = "val_bpb") -> str:
    """"reproduced", "reversed" or "undecided" by chapter 12's rule
    (:func:`k3course.lessons.seed_statistics.paired`)."""
    return _paired(name, better, worse, metric)["verdict"]


@quoted
def claim_fact(name: str, variant: str, fact: str) -> float:
    """A variant's saved description: "active_params", "total_params", "moe_flops_per_token", ..."""
    return _saved(name)["result"]["variants"][variant][fact]


@quoted
def claim_fact_gap(name: str, variant: str, other: str, fact: str) -> float:
    """``variant``'s saved fact minus ``other``'s."""
    return claim_fact(name, variant, fact) - claim_fact(name, other, fact)


@quoted
def claim_fact_ratio(name: str, variant: str, other: str, fact: str) -> float:
    """``variant``'s saved fact over ``other``'s."""
    return claim_fact(name, variant, fact) / claim_fact(name, other, fact)


@quoted
def claim_minutes(name: str, variant: str | None = None) -> Pair:
    """The shortest and the longest saved run of a claim (of its ``variant`` if given), in minutes (one thread
    each)."""
    seconds = [run["seconds"] for run in _saved(name)["result"]["runs"] if variant in (None, run["variant"])]
    if not seconds:
        raise KeyError(f"variant: {name} has no runs of {variant!r}")
    return span(min(seconds) / 60, max(seconds) / 60)


@quoted
def solved_seeds(name: str, variant: str, threshold: float = 0.9) -> str:
    """``solved/seeds``: the seeds of a saved MQAR variant whose accuracy is above ``threshold``."""
    values = _values(name, variant, "accuracy")
    return f"{sum(v > threshold for v in values)}/{len(values)}"


def _cpu_seconds(name: str) -> float:
    """What saved experiment ``name`` took to train: a claim's runs and tuning runs summed
    (:func:`k3course.lessons.seed_statistics.cpu_seconds`, one thread per run, runs copied from other results left
    out); a recall-model experiment (one process on one thread, whose tuning runs keep no times) its wall time."""
    saved = _saved(name)
    return seed_statistics.cpu_seconds(saved["result"], name) if "claim" in saved["settings"] else saved["seconds"]


@quoted
def claim_cpu_hours(*names: str) -> float:
    """CPU-hours the saved experiments ``names`` took to train together (:func:`_cpu_seconds`)."""
    return sum(_cpu_seconds(name) for name in names) / 3600


@quoted
def claim_cpu_minutes(name: str) -> float:
    """The same in CPU-minutes."""
    return claim_cpu_hours(name) * 60


@quoted
def sweep_chosen(field: str) -> int:
    """The saved MQAR sweep's chosen cell: its "steps", "n_pairs" or "head_dim"."""
    result = _saved("mqar-sweep")["result"]
    return result["cells"][result["chosen"]][field]


@quoted
def sweep_cells_tried() -> int:
    """How many cells the saved MQAR sweep trained before it stopped (the chosen one included)."""
    return len(_saved("mqar-sweep")["result"]["cells"])


@quoted
def gpu_over_default(what: str = "bytes") -> float:
    """The GPU budget (``experiments.GPU_TEXT_TRAIN``) over the default run's, per claim run: "bytes" trained,
    "steps" or "batch" (bytes per step)."""
    from k3course.lessons import claims

    gpu, default = experiments.GPU_TEXT_TRAIN, claims.DEFAULT_TEXT_TRAIN
    per_step = lambda settings: settings.batch_size * settings.seq_len
    ratios = {"steps": gpu.steps / default.steps, "batch": per_step(gpu) / per_step(default)}
    return ratios[what] if what in ratios else ratios["steps"] * ratios["batch"]


@quoted
def gpu_budget_hours() -> float:
    """GPU-hours of the four GPU-budget claims in one process, from the step times measured on an H200
    (``results/gpu_budget.json``, :func:`k3course.lessons.experiments.gpu_budget_hours`)."""
    return experiments.gpu_budget_hours(experiments.gpu_step_ms(), experiments.GPU_TEXT_TRAIN)


@quoted
def gpu_step_ms(claim: str, variant: str) -> float:
    """A GPU-budget variant's training step on the H200, ms (``results/gpu_budget.json``)."""
    return experiments.gpu_step_ms()[claim][variant]


@quoted
def violation_first_step() -> Pair:
    """Max-violation at step 1 across every saved balancing run."""
    firsts = [run["max_violation"][0] for run in _saved("balancing")["result"]["runs"]]
    return span(min(firsts), max(firsts))


@quoted
def violation_possible(n_experts: int, k: int = 2) -> float:
    """The largest max-violation top-k of n can reach (every token picks the same k): n/k − 1."""
    return n_experts / k - 1


@quoted
def sign_rule_reach(steps: int = 120, gamma: float = 1e-3) -> float:
    """How far the sign rule can move a bias in ``steps`` steps of ``gamma``."""
    return steps * gamma


@quoted
def train_bytes(which: str = "claims") -> float:
    """Bytes a run trains on: "claims" (TEXT_TRAIN) in kB, "default" (the 800-step tiny-default) or "shipped" (the
    2400-step run of the model the package ships) in MB."""
    import dataclasses

    from k3course.lessons import capstone, claims
    from k3course.train.config import train_preset

    settings = {"claims": lambda: dataclasses.asdict(claims.TEXT_TRAIN),
                "default": lambda: dataclasses.asdict(train_preset("tiny")[1]),
                "shipped": lambda: capstone.shipped_config()["train"]}[which]()
    nbytes = settings["steps"] * settings["batch_size"] * settings["seq_len"]
    return nbytes / 1e3 if which == "claims" else nbytes / 1e6


@quoted
def epoch_fraction(which: str = "claims") -> float:
    """The share of one pass over the saved corpus's training split that a run reads (in windows at seeded random
    offsets, so some bytes more than once and others never)."""
    splits = _saved("tiny-default")["result"]["corpus"]["splits"]
    scale = 1e3 if which == "claims" else 1e6
    return train_bytes(which) * scale / splits["train"]["bytes"]


@quoted
def default_over_claims() -> float:
    """How many times more bytes the 800-step default run reads than a claim run."""
    return train_bytes("default") * 1e6 / (train_bytes("claims") * 1e3)


@quoted
def default_val_bpb(step: int = 800) -> float:
    """The saved default run's validation bits/byte at ``step``."""
    return next(r["val_bpb"] for r in _saved("tiny-default")["result"]["metrics"] if r["step"] == step
                and "val_bpb" in r)


@quoted
def default_baseline(name: str) -> float:
    """A baseline (unigram, bigram, trigram, lzma-9) of the saved default run's split, bits/byte."""
    return _saved("tiny-default")["result"]["baselines"][name]


@quoted
def default_bytes_per_s() -> float:
    """The median training throughput of the saved default run, bytes (= tokens) per second."""
    speeds = sorted(r["tokens_per_s"] for r in _saved("tiny-default")["result"]["metrics"])
    return speeds[len(speeds) // 2]


@quoted
def default_minutes() -> float:
    """Wall minutes of the saved default run (training and its evaluations)."""
    return _saved("tiny-default")["result"]["train_seconds"] / 60


@quoted
def default_violation(which: str) -> float:
    """The saved default run's max-violation: "first" step, or the median of the "last100"."""
    violations = [r["max_violation"] for r in _saved("tiny-default")["result"]["metrics"]]
    return violations[0] if which == "first" else sorted(violations[-100:])[50]


@quoted
def expert_slots(n_experts: int = 112, what: str = "step") -> float:
    """Token-slots one of ``n_experts`` gets per claim step ("step") or over the run ("run"), top-2, uniform."""
    from k3course.lessons import claims

    settings = claims.TEXT_TRAIN
    per_step = settings.batch_size * settings.seq_len * 2 / n_experts
    return per_step if what == "step" else per_step * settings.steps

@functools.cache
def _train_bench() -> dict:
    return json.loads((experiments.RESULTS / "train_bench.json").read_text())


@quoted
def train_step_ratio(mode: str = "eager") -> float:
    """The saved ``bench train``: the tiny K3's training step time over its dense baseline's, ``mode`` "eager" or
    "compiled" (= how many more steps the dense model takes in the same wall time)."""
    return _train_bench()["ratios"]["tiny"][f"K3 / dense, {mode}"]


@quoted
def compile_speedup(model: str = "tiny") -> float:
    """The saved ``bench train``: ``model``'s eager step time over its compiled step time."""
    return 1 / _train_bench()["ratios"]["tiny"][f"{model} compiled / eager"]

@functools.cache
def _train_sweep() -> dict:
    return json.loads((experiments.RESULTS / "train_sweep.json").read_text())


def _sweep_ratios(mode: str) -> dict[int, float]:
    ratios = {point["seq_len"]: point["ratio"] for point in _train_sweep()["points"] if point["mode"] == mode}
    if not ratios:
        raise KeyError(f"mode: the saved train sweep has no {mode!r} points")
    return ratios


@quoted
def train_sweep_ratio(seq_len: int, mode: str = "eager") -> float:
    """The saved ``bench train --sweep``: the tiny K3's step time over its dense baseline's at sequence length
    ``seq_len``, the same bytes per step at every length (below 1: K3's step is the faster)."""
    return _sweep_ratios(mode)[seq_len]


@quoted
def train_sweep_crossover(mode: str = "eager") -> int:
    """The saved ``bench train --sweep``: the shortest sequence length from which on (it and every longer one
    swept) the tiny K3's step is no slower than its dense baseline's."""
    ratios = _sweep_ratios(mode)
    winning = [seq for seq in sorted(ratios) if all(ratios[longer] <= 1 for longer in ratios if longer >= seq)]
    if not winning:
        raise ValueError(f"in the saved train sweep K3 is slower than dense at the longest length ({mode})")
    return winning[0]


@quoted
def train_sweep_bytes() -> int:
    """The saved ``bench train --sweep``: bytes per training step at every sequence length."""
    return _train_sweep()["bytes_per_step"]


@quoted
def claim_equal_time_steps(name: str) -> int:
    """Steps the faster variant of a saved equal-time claim took in the slower one's wall time."""
    saved = _saved(name)
    faster = saved["settings"]["equal_time"][1]
    return next(run["steps"] for run in saved["result"]["runs"]
                if run["variant"] == experiments.equal_time_label(faster))


@quoted
def claim_step_ratio(name: str = "dense-baseline-default") -> float:
    """A saved equal-time claim's step-time ratio, slower over faster, as its run measured it (one thread, the two
    models taking turns): the ratio its equal-time steps come from."""
    saved = _saved(name)
    slower, faster = saved["settings"]["equal_time"]
    seconds = saved["result"]["step_seconds"]
    return seconds[slower] / seconds[faster]


@quoted
def thread_speedup(model: str) -> float:
    """How much faster ``model``'s training step ("tiny K3" or "dense Transformer") ran on the saved ``bench train``'s
    two threads (eager) than in dense-baseline-default's one-thread step timing."""
    bench = {"tiny K3": "tiny", "dense Transformer": "dense (tiny)"}[model]
    two = next(row["step_s"] for row in _train_bench()["rows"] if row["model"] == bench and row["mode"] == "eager")
    return _saved("dense-baseline-default")["result"]["step_seconds"][model] / two


@quoted
def t_critical(df: int) -> float:
    """Student's t at 97.5 % with ``df`` degrees of freedom: the factor on the standard error in chapter 12's
    95% interval (:func:`k3course.lessons.seed_statistics.t_quantile`)."""
    return seed_statistics.t_quantile(0.975, df)
