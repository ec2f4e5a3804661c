"""The learner's loop: a solved notebook, run and saved with outputs, passes strict ``pytest --nbval``.

The README's test command checks ``solutions/`` with strict nbval against the outputs stored in each notebook:
nbval runs the notebook afresh and compares every cell with what was stored. This test checks that what is stored
is what a learner's saved run leaves — every code cell run exactly once, top to bottom, no error, the check cells
among them — so that the nbval run is the loop itself (run, save, ``pytest --nbval``), without running every
solution a second and a third time.
"""

from __future__ import annotations

import nbformat
import pytest
from helpers import notebooks

from k3course.grading.notebooks import check_ids


@pytest.mark.parametrize("path", notebooks("solutions"), ids=lambda p: p.name)
def test_stored_outputs_are_one_saved_run_top_to_bottom(path):
    cells = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
    assert any(check_ids(cell.source) for cell in cells), f"{path.name} has no check cells"
    counts = [cell.execution_count for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{path.name}: execution counts {counts} (run it once, in order)"
    errors = [i for i, cell in enumerate(cells) if any(out.output_type == "error" for out in cell.outputs)]
    assert not errors, f"{path.name}: code cells {errors} store an error"
    checks = [cell for cell in cells if check_ids(cell.source)]
    assert all(cell.outputs for cell in checks), f"{path.name}: a check cell stores no output (not run?)"
