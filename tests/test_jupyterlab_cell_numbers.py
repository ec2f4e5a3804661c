"""A failing notebook cell is reported with the number JupyterLab shows beside it (the repository's conftest.py)."""

from __future__ import annotations

import subprocess
import sys

import nbformat
from helpers import ROOT


def test_failing_cells_are_named_as_jupyterlab_numbers_them_after_run_all(tmp_path):
    path = tmp_path / "lesson.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# A lesson"),
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_markdown_cell("text between"),
        nbformat.v4.new_code_cell("# a comment first\nassert x == 2, 'x is not 2'"),
        nbformat.v4.new_code_cell("y = 2"),
        nbformat.v4.new_code_cell("assert y == 3, 'y is not 3'"),
    ]), path)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:xdist", "-p", "no:cacheprovider",
                          "--nbval", "--nbval-current-env", str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "where in JupyterLab" in run.stdout, run.stdout
    assert 'nbval\'s "Cell 1" counts code cells from 0: after Kernel > Restart Kernel and Run All Cells, ' \
        "JupyterLab shows it as [2], the code cell that starts with:\n    assert x == 2, 'x is not 2'" in run.stdout
    # Run All stops at the first error: the second failing cell never gets a number, and the report says so
    assert "JupyterLab shows it as code cell 4 (Run All stops before it, at the error in [2]), the code cell that " \
        "starts with:\n    assert y == 3, 'y is not 3'" in run.stdout
