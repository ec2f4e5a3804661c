"""pytest, run from the repository (``pytest --nbval exercises/01_sparse_moe_exercises.ipynb``): say which cell
failed the way JupyterLab numbers it.

nbval names a notebook's items "Cell 0", "Cell 1", ... counting code cells from 0; JupyterLab shows no such
number, only the execution count ``[n]`` beside each code cell, which after *Restart Kernel and Run All Cells*
counts the code cells from 1. A failing cell's report gets a section with that number and the cell's first line.
"""

from __future__ import annotations

import pytest


def jupyterlab_position(cell_num: int, source: str) -> str:
    """The report line for nbval's "Cell ``cell_num``" whose source is ``source``."""
    first = next((line for line in source.splitlines() if line.strip() and not line.startswith("#")), "")
    return (f'nbval\'s "Cell {cell_num}" counts code cells from 0: in JupyterLab it is the code cell marked '
            f"[{cell_num + 1}] after Kernel > Restart Kernel and Run All Cells, the one that starts with:\n"
            f"    {first}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    cell_num, cell = getattr(item, "cell_num", None), getattr(item, "cell", None)
    if report.failed and isinstance(cell_num, int) and cell is not None:
        report.sections.append(("where in JupyterLab", jupyterlab_position(cell_num, cell.source)))
