"""pytest, run from the repository (``pytest --nbval exercises/01_sparse_moe_exercises.ipynb``): say which cell
failed the way JupyterLab numbers it.

nbval names a notebook's items "Cell 0", "Cell 1", ... counting code cells from 0 and runs every one, past errors;
JupyterLab shows no such number, only the execution count ``[n]`` beside each code cell, which after *Restart Kernel
and Run All Cells* counts the code cells from 1 up to the first cell that raises, where Run All stops. A failing
cell's report gets a section with that number (or, past the stop, its position) and the cell's first line.
"""

from __future__ import annotations

import pytest

# per notebook (nbval's item parent), the number from 0 of the first code cell that raised in this session
_FIRST_RAISED: dict[object, int] = {}


def jupyterlab_position(cell_num: int, source: str, first_raised: int | None) -> str:
    """The report line for nbval's "Cell ``cell_num``" whose source is ``source``, when the notebook's first cell
    to raise is nbval's "Cell ``first_raised``" (None: none raised)."""
    from k3course.grading.progress import run_all_label  # here, not at the top: importing k3course.grading loads torch

    first = next((line for line in source.splitlines() if line.strip() and not line.startswith("#")), "")
    label = run_all_label(cell_num + 1, None if first_raised is None else first_raised + 1)
    return (f'nbval\'s "Cell {cell_num}" counts code cells from 0: after Kernel > Restart Kernel and Run All Cells, '
            f"JupyterLab shows it as {label}, the code cell that starts with:\n    {first}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    cell_num, cell = getattr(item, "cell_num", None), getattr(item, "cell", None)
    if call.when != "call" or not isinstance(cell_num, int) or cell is None:
        return
    if any(out.get("output_type") == "error" for out in getattr(item, "test_outputs", None) or []):
        _FIRST_RAISED.setdefault(item.parent, cell_num)
    if report.failed:
        report.sections.append(("where in JupyterLab",
                                jupyterlab_position(cell_num, cell.source, _FIRST_RAISED.get(item.parent))))
