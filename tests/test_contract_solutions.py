"""The learner's loop: a solved notebook, run and saved with outputs, passes strict ``pytest --nbval``."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest
from helpers import notebooks

from k3course.grading.notebooks import execute


@pytest.mark.parametrize("path", notebooks("solutions"), ids=lambda p: p.name)
def test_solved_run_saved_then_strict_nbval(path, tmp_path):
    nb, results = execute(path)
    errors = [f"cell {r.index}: {r.error_name}: {r.error_value}" for r in results if r.error_name]
    assert not errors, "; ".join(errors)
    assert any(r.is_check for r in results), f"{path.name} has no check cells"
    saved = tmp_path / path.name
    nbformat.write(nb, saved)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                          "--nbval-current-env", str(saved)], cwd=path.parent, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:]
