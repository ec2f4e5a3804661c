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


# Lessons without exercises: 15 checks your model against transformers' checkpoints, 16 runs your exercise functions
LESSONS_ONLY = {"15_kimi_linear", "16_capstone"}


def test_each_lesson_has_an_exercise_pair():
    """NN_name.ipynb in notebooks/, NN_name_exercises.ipynb in solutions/ and exercises/: a lesson and its exercises
    open in JupyterLab tabs with different names (every lesson but those of LESSONS_ONLY)."""
    lessons = {p.stem for p in notebooks("notebooks")}
    assert lessons, "no lessons found"
    assert LESSONS_ONLY <= lessons, f"LESSONS_ONLY names lessons that are gone: {sorted(LESSONS_ONLY - lessons)}"
    lessons -= LESSONS_ONLY
    for folder in ("solutions", "exercises"):
        assert {p.stem for p in notebooks(folder)} == {f"{stem}_exercises" for stem in lessons}, folder


def test_every_notebook_a_learner_is_pointed_to_exists():
    """A path to a notebook in the lessons, solutions, exercises or the README names a file that is there."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("notebooks/*.ipynb"), *root.glob("solutions/*.ipynb"), *root.glob("exercises/*.ipynb"),
             root / "README.md", root / "notebooks" / "references.md"]
    named = {match for path in files for match in
             re.findall(r"\b(?:notebooks|exercises|solutions)/[0-9][0-9]_\w+\.ipynb", path.read_text(encoding="utf-8"))}
    assert named, "no notebook paths found"
    missing = sorted(name for name in named if not (root / name).is_file())
    assert not missing, missing


def test_nothing_a_learner_reads_cites_a_file_outside_the_repository():
    """Lessons, exercises, docstrings and the README point at lessons and papers, never at "DESIGN §N" (the
    course's design notes are not shipped to learners)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("k3course/**/*.py"), *root.glob("notebooks/*.ipynb"), *root.glob("solutions/*.ipynb"),
             *root.glob("exercises/*.ipynb"), root / "README.md"]
    citing = [str(path.relative_to(root)) for path in files if "DESIGN §" in path.read_text(encoding="utf-8")]
    assert not citing, f"these cite DESIGN §N, which learners do not have: {citing}"


@pytest.mark.parametrize("path", notebooks("notebooks"), ids=lambda p: p.name)
def test_a_printed_check_is_backed_by_an_assert(path):
    """nbval compares a cell's output with the stored one, so a stored "…: False" passes forever: a cell that
    prints a check's truth value ("…: True") must also assert it (cells whose output is ignored are exempt)."""
    import re

    for index, cell in enumerate(nbformat.read(path, 4).cells):
        if cell.cell_type != "code" or "NBVAL_IGNORE_OUTPUT" in cell.source:
            continue
        printed = "".join(output.get("text", "") for output in cell.outputs)
        if re.search(r":\s*(True|False)\b", printed):
            assert "assert" in cell.source, f"cell {index} prints a check without asserting it"


@pytest.mark.parametrize("path", notebooks("notebooks") + notebooks("solutions") + notebooks("exercises"),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebooks_store_the_kernelspec_jupyterlab_writes(path):
    """Opening a notebook in JupyterLab must not modify it: it stores JupyterLab's own kernelspec."""
    from k3course.grading.build import KERNELSPEC

    assert dict(nbformat.read(path, 4).metadata.get("kernelspec", {})) == KERNELSPEC


@pytest.mark.parametrize("path", notebooks("notebooks"), ids=lambda p: p.name)
def test_stored_widgets_and_progress_bars_read_well_before_they_run(path):
    """Opened before its cells run (or on a code host), a lesson shows no widget repr ("interactive(children=…")
    and no progress bar frozen short of its end ("0/20"): widgets come from ``lessons.notebook.sliders``, whose
    plain-text form names the controls, and progress bars are text saved as they ended."""
    import json
    import re

    for index, cell in enumerate(nbformat.read(path, 4).cells):
        if cell.cell_type != "code":
            continue
        assert not re.search(r"\binteract\(|@interact\b", cell.source), f"cell {index}: use sliders(), not interact"
        stored = json.dumps(cell.outputs, ensure_ascii=False)
        assert "interactive(children" not in stored, f"cell {index} stores a widget's repr"
        for done, total in re.findall(r"\|\s*(\d+)/(\d+) \[", stored):
            assert done == total, f"cell {index} stores a progress bar at {done}/{total}"
