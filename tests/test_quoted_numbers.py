"""A number in a lesson's text that comes from a computation is that computation's value.

Lessons, solutions, exercises and the README mark each such number with ``<!--q:NAME(ARGS)|FMT-->`` (invisible
when rendered); :mod:`k3course.lessons.quoted` computes it. These tests evaluate every marker, show that a wrong
number fails, and hold the numbers the course once got wrong to their computation.
"""

from __future__ import annotations

import re

import nbformat
import pytest
from helpers import ROOT, notebooks

from k3course.lessons import quoted


def markdown_of(path) -> str:
    """The text a learner reads: a notebook's markdown cells, or a markdown file."""
    if path.suffix == ".ipynb":
        return "\n\n".join(cell.source for cell in nbformat.read(path, 4).cells if cell.cell_type == "markdown")
    return path.read_text(encoding="utf-8")


FILES = [*notebooks("notebooks"), *notebooks("solutions"), *notebooks("exercises"), ROOT / "README.md"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_marked_number_is_its_computation(path):
    _, mismatches = quoted.check_text(markdown_of(path))
    assert not mismatches, "\n".join(map(str, mismatches))


def test_a_number_that_disagrees_with_its_computation_fails():
    """The deliberate mismatch: K3's active parameters count to 105B; a text that says 104B is caught, and so are
    a truncated number, an unknown name and a malformed marker."""
    assert quoted.evaluate("active_params_b|.0f") == "105"
    count, mismatches = quoted.check_text("about <!--q:active_params_b|.0f-->105 billion per token")
    assert count == 1 and not mismatches
    for wrong in ("about <!--q:active_params_b|.0f-->104 billion",      # the number the course used to print
                  "<!--q:total_params_t|.1f-->2.78T",                   # "2.8" continued by another digit
                  "<!--q:claim('residuals', 'PreNorm')|.2f-->4.31 ± 0.07",
                  "<!--q:no_such_number-->1", "<!--q:active_params_b(|.0f-->105"):
        count, mismatches = quoted.check_text(wrong)
        assert count == 1 and len(mismatches) == 1, wrong


def test_quoted_values_format_both_ends():
    assert f"{quoted.plus_minus(3.9361, 0.0617):.2f}" == "3.94 ± 0.06"
    assert f"{quoted.span(3.865, 3.977):.2f}" == "3.87–3.98"
    assert quoted.normalise("−74%") == "-74%"


def markers_in(path) -> set[str]:
    return {match["body"].strip() for match in quoted.MARKER.finditer(markdown_of(path))}


# The numbers the course once printed wrong, and where: each must now be quoted under its computation.
ONCE_WRONG = {
    "README.md": ["active_params_b|.0f", "default_minutes|.0f"],
    "notebooks/00_tour.ipynb": ["active_params_b|.0f", 'cache_gib("kimi-k3", 1048576)|.1f',
                                'cache_gib("kimi-k3", 1048576, "all-mla")|.1f', "crossover|,d"],
    "notebooks/09_gated_mla.ipynb": ["state_mib|.0f", "crossover|,d", 'cache_gib("kimi-k3", 1048576)|.1f'],
    "notebooks/11_model.ipynb": ['component_share("kimi-k3", "routed_experts")|.0%',
                                 'component_share("kimi-k3", "routed_experts", "active")|.0%',
                                 "active_params_b|.0f"],
    "solutions/11_model_exercises.ipynb": ['component_share("kimi-k3", "routed_experts", "active")|.0%',
                                           "active_params_b|.0f"],
    "exercises/11_model_exercises.ipynb": ['component_share("kimi-k3", "routed_experts", "active")|.0%'],
    "notebooks/14_decoding.ipynb": ["crossover|,d", "active_params_b|.0f"],
    "notebooks/12_train.ipynb": ["default_minutes|.0f"],
    "notebooks/16_capstone.ipynb": ["default_minutes|.0f"],
}


@pytest.mark.parametrize("name", ONCE_WRONG)
def test_the_numbers_once_wrong_are_quoted_under_their_computation(name):
    missing = set(ONCE_WRONG[name]) - markers_in(ROOT / name)
    assert not missing, f"{name} no longer quotes {sorted(missing)} under a marker"


@pytest.mark.parametrize("path", [*notebooks("notebooks"), *notebooks("solutions"), ROOT / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_default_runs_time_is_the_saved_runs(path):
    """The 800-step default run once took "6 minutes" in lesson 12 and "about 10" in lesson 16: every paragraph that
    names the 800-step run and a time in minutes quotes the time of the saved run."""
    for paragraph in markdown_of(path).split("\n\n"):
        if re.search(r"\b800[-\s]step", paragraph) and re.search(r"\bminutes?\b", paragraph):
            assert re.search(r"<!--q:default_minutes\|\.0f-->\d+ minutes", paragraph), paragraph


@pytest.mark.parametrize("path", [*notebooks("notebooks"), *notebooks("solutions"), ROOT / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_memory_is_in_binary_units(path):
    """One convention: memory in KiB / MiB / GiB (2¹⁰, 2²⁰, 2³⁰ bytes); only rates are decimal (GB/s, TB/s)."""
    text = markdown_of(path)
    if path.suffix == ".ipynb":
        text += "\n".join(cell.source for cell in nbformat.read(path, 4).cells if cell.cell_type == "code")
    decimal = re.findall(r"\d\s?(?:kB|MB|GB|TB)\b(?!/s)|\b(?:kB|MB|GB|TB)\b(?!/s)(?=[,)\s]*\(?bf16)", text)
    assert not decimal, f"decimal memory units {decimal}: write KiB, MiB, GiB"


def test_the_lessons_1m_context_is_kimi_k3s_context_length_2_to_the_20():
    from k3course.config import K3Config

    assert quoted.CONTEXT_1M == 2**20 == K3Config.preset("kimi-k3").context_length


def test_lesson_15_quotes_what_kimi_linear_48b_needs_under_its_computation():
    """The bf16 weights, GFLOP and GiB read per decoded token of Kimi-Linear-48B-A3B come from the preset."""
    needed = {"pretrained_weights_gib|.1f", "decode_gflop|.1f", "decode_read_gib|.1f"}
    assert needed <= markers_in(ROOT / "notebooks" / "15_kimi_linear.ipynb")
    assert [quoted.evaluate(body) for body in sorted(needed)] == ["6.3", "5.8", "91.5"]


def test_every_chapters_numbers_are_registered_and_reachable_as_attributes():
    from k3course.lessons.quoted import claims, size

    assert quoted.active_params_b is size.active_params_b is quoted.QUOTED["active_params_b"]
    assert quoted.claim_equal_time_steps is claims.claim_equal_time_steps
    assert all(function.__module__.startswith("k3course.lessons.quoted.") for function in quoted.QUOTED.values())
    with pytest.raises(AttributeError, match="no attribute 'no_such_number'"):
        quoted.no_such_number  # noqa: B018


def test_the_train_sweep_crossover_is_the_length_from_which_k3_stays_no_slower(monkeypatch):
    from k3course.lessons.quoted import claims

    ratios = {128: 2.1, 256: 1.6, 512: 0.9, 1024: 1.05, 2048: 0.6, 4096: 0.4}  # 512 alone is not a crossover
    points = [{"seq_len": seq, "mode": "eager", "ratio": ratio} for seq, ratio in ratios.items()]
    monkeypatch.setattr(claims, "_train_sweep", lambda: {"bytes_per_step": 4096, "points": points})
    assert quoted.evaluate("train_sweep_crossover|d") == "2048" and quoted.evaluate("train_sweep_bytes|,d") == "4,096"
    assert quoted.evaluate("train_sweep_ratio(512)|.2f") == "0.90"
    with pytest.raises(KeyError, match="mode"):
        claims.train_sweep_ratio(512, "compiled")
    points[-1]["ratio"] = 1.2
    with pytest.raises(ValueError, match="slower"):
        claims.train_sweep_crossover()
