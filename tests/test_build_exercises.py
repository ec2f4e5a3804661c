"""The exercise build: solutions/ is the single source of exercises/ (the grading contract in the README)."""

from __future__ import annotations

import nbformat
import pytest
from helpers import ROOT

from k3course.cli import main
from k3course.grading.build import STUB, MarkerError, build, stub_source

SOLVED = '''def add_one(x):
    """Return x + 1.

    Hint: one line.
    """
    ### BEGIN SOLUTION
    y = x + 1
    return y
    ### END SOLUTION'''


def test_committed_exercises_are_in_sync():
    assert build(ROOT, check_only=True) == []


def test_stub_keeps_signature_docstring_and_hint():
    stubbed = stub_source(SOLVED, "cell")
    assert stubbed.startswith('def add_one(x):\n    """Return x + 1.')
    assert "Hint: one line." in stubbed
    assert stubbed.endswith("\n    " + STUB)
    assert "return y" not in stubbed
    namespace = {}
    exec(stubbed, namespace)
    with pytest.raises(NotImplementedError):
        namespace["add_one"](1)


@pytest.mark.parametrize("source, message", [
    ("### BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n### END SOLUTION", "without a"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "nested"),
])
def test_unbalanced_markers_are_errors(source, message):
    with pytest.raises(MarkerError, match=message):
        stub_source(source, "cell")


def _write_course(root, solved_source):
    (root / "solutions").mkdir()
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(solved_source, execution_count=3)
    cell.outputs = [nbformat.v4.new_output("stream", text="hi\n")]
    nb.cells = [nbformat.v4.new_markdown_cell("# 99 toy"), cell]
    nbformat.write(nb, root / "solutions" / "99_toy.ipynb")


def test_build_then_check_then_stale(tmp_path, capsys):
    _write_course(tmp_path, SOLVED)
    assert build(tmp_path, check_only=True)  # missing exercise is reported
    assert main(["build-exercises", "--root", str(tmp_path)]) == 0
    exercise = nbformat.read(tmp_path / "exercises" / "99_toy.ipynb", 4)
    code = exercise.cells[1]
    assert code.outputs == [] and code.execution_count is None and STUB in code.source
    assert main(["build-exercises", "--check", "--root", str(tmp_path)]) == 0
    _write_course_edit = tmp_path / "solutions" / "99_toy.ipynb"
    nb = nbformat.read(_write_course_edit, 4)
    nb.cells[1].source = nb.cells[1].source.replace("Hint: one line.", "Hint: changed.")
    nbformat.write(nb, _write_course_edit)
    capsys.readouterr()
    assert main(["build-exercises", "--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Hint: changed." in err and "out of sync" in err


def test_unbalanced_marker_exits_nonzero(tmp_path, capsys):
    _write_course(tmp_path, "### BEGIN SOLUTION\nx = 1")
    assert main(["build-exercises", "--check", "--root", str(tmp_path)]) == 2
    assert "99_toy.ipynb, cell 1" in capsys.readouterr().err


def test_missing_solutions_folder_is_named(tmp_path, capsys):
    assert main(["build-exercises", "--check", "--root", str(tmp_path)]) == 2
    assert "no solutions/ folder" in capsys.readouterr().err
