"""Unsolved exercise notebooks fail exactly at their check cells, each with ExerciseNotDone."""

from __future__ import annotations

import pytest
from helpers import notebooks

from k3course.grading.notebooks import execute


@pytest.mark.parametrize("path", notebooks("exercises"), ids=lambda p: p.name)
def test_unsolved_fails_only_at_check_cells(path):
    _, results = execute(path)
    check_cells = {r.index for r in results if r.is_check}
    failing = {r.index: r for r in results if r.error_name}
    assert check_cells, f"{path.name} has no check cells"
    assert set(failing) == check_cells, (
        f"failing cells {sorted(failing)} != check cells {sorted(check_cells)}: "
        + "; ".join(f"cell {i}: {r.error_name}: {r.error_value}" for i, r in failing.items()))
    for r in failing.values():
        assert r.error_name == "ExerciseNotDone", f"cell {r.index}: {r.error_name}: {r.error_value}"
