"""Chapter 12's verdict rule: a two-sided 95% t-interval of the mean paired difference over the seeds — reproduced
when it lies above 0, reversed when below, undecided otherwise — and every verdict word lesson 12 writes is that
rule applied to the saved runs, recomputed here from the runs with a t table of its own."""

from __future__ import annotations

import ast
import json
import re

import pytest
from helpers import ROOT

from k3course.lessons import experiments, seed_statistics
from k3course.lessons.quoted import claims as quoted_claims
from k3course.lessons.quoted import markers

# Student's t, 97.5th percentile, by degrees of freedom (any statistics table)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
LESSON = ROOT / "notebooks" / "12_train.ipynb"


def test_t_quantiles_match_the_table():
    for df, value in T975.items():
        assert seed_statistics.t_quantile(0.975, df) == pytest.approx(value, abs=1e-3)
    assert seed_statistics.t_quantile(0.95, 10) == pytest.approx(1.812, abs=1e-3)
    for bad in ({"df": 0}, {"df": 2.0}, {"df": True}, {"probability": 0.5}, {"probability": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            seed_statistics.t_quantile(**{"probability": 0.975, "df": 3, **bad})


def test_the_rule_is_monotone_in_the_evidence():
    """The issue's case: three seeds +0.002, +0.03, +0.09 (all won, t ≈ 1.5) are undecided; three seeds that all
    lost by 0.013 ± 0.007 (t ≈ −3.3, not enough at 2 degrees of freedom) too; five such seeds are reversed. Shifting
    every difference up never turns a reproduced claim undecided, or an undecided one reversed."""
    assert seed_statistics.verdict([0.002, 0.03, 0.09])["verdict"] == "undecided"
    assert seed_statistics.verdict([-0.006, -0.014, -0.020])["verdict"] == "undecided"
    assert seed_statistics.verdict([-0.006, -0.014, -0.020, -0.012, -0.015])["verdict"] == "reversed"
    assert seed_statistics.verdict([0.1])["verdict"] == "undecided"  # one seed: no interval
    order = {"reversed": 0, "undecided": 1, "reproduced": 2}
    base = [0.01, -0.02, 0.04, 0.005]
    words = [seed_statistics.verdict([d + shift / 100 for d in base])["verdict"] for shift in range(-8, 9)]
    assert [order[w] for w in words] == sorted(order[w] for w in words) and words[0] == "reversed" \
        and words[-1] == "reproduced"


def _recomputed(name: str, better: str, worse: str, metric: str) -> str:
    """The rule applied by hand to the saved runs: paired differences, mean ± t·s/√n with :data:`T975`."""
    result = quoted_claims._result(name)
    key = "mixer" if name == "mqar-sweep" else "variant"
    values = {label: {run["seed"]: run[metric] for run in result["runs"] if run[key] == label} for label in (better,
                                                                                                           worse)}
    seeds = sorted(set(values[better]) & set(values[worse]))
    sign = 1 if metric == "accuracy" else -1
    d = [sign * (values[better][s] - values[worse][s]) for s in seeds]
    n = len(d)
    mean = sum(d) / n
    half = T975[n - 1] * (sum((x - mean) ** 2 for x in d) / (n - 1)) ** 0.5 / n ** 0.5
    return "reproduced" if mean - half > 0 else "reversed" if mean + half < 0 else "undecided"


def _verdict_markers() -> list[tuple[str, tuple, str]]:
    """(function, arguments, the word written after it) of every verdict marker in lesson 12's markdown."""
    cells = json.loads(LESSON.read_text(encoding="utf-8"))["cells"]
    text = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    found = []
    for match in markers.MARKER.finditer(text):
        call = re.fullmatch(r"(claim_verdict|mqar_verdict)\((.*)\)", match["body"].strip(), re.S)
        if call:
            written = re.match(r"\w+", text[match.end():])[0]
            found.append((call[1], ast.literal_eval(f"({call[2]},)"), written))
    return found


def test_every_verdict_in_lesson_12_is_the_rule_applied_to_the_saved_runs():
    found = _verdict_markers()
    assert len(found) > 40
    for function, args, written in found:
        name, better, worse, *rest = args
        metric = "accuracy" if function == "mqar_verdict" else (rest[0] if rest else "val_bpb")
        expected = _recomputed(name, better, worse, metric)
        assert written == expected, f"{function}{args}: the lesson says {written!r}, the saved runs {expected!r}"


@pytest.mark.parametrize("name", [name for name in experiments.EXPERIMENTS
                                  if "claim" in experiments.EXPERIMENTS[name][1]])
def test_every_saved_claim_is_graded_by_the_one_rule(name):
    """Every pair of every saved claim gets a verdict and an interval from the same function."""
    result = experiments.load(name)["result"]
    labels = list(result["variants"])
    for other in labels[1:]:
        comparison = seed_statistics.paired(result, labels[0], other,
                                            "accuracy" if "accuracy" in result["runs"][0] else "val_bpb",
                                            higher_is_better="accuracy" in result["runs"][0])
        low, high = comparison["interval"]
        assert low <= comparison["mean"] <= high
        assert comparison["verdict"] == seed_statistics.verdict(list(comparison["differences"].values()))["verdict"]
