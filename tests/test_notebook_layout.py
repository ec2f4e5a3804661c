"""Every chapter has its lesson, solutions and exercises, and each notebook states its runtime at the top."""

from __future__ import annotations

import nbformat
import pytest
from helpers import notebooks


@pytest.mark.parametrize("path", notebooks("notebooks") + notebooks("solutions") + notebooks("exercises"),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_first_cell_is_a_title_with_the_measured_runtime(path):
    first = nbformat.read(path, 4).cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "the first cell must be a title"
    assert "Runtime on a 2-core CPU: about" in first.source, "state the measured runtime at the top"


def test_each_lesson_has_an_exercise_pair():
    lessons = {p.name for p in notebooks("notebooks")}
    assert lessons, "no lessons found"
    assert lessons == {p.name for p in notebooks("solutions")} == {p.name for p in notebooks("exercises")}
