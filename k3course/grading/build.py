"""Build ``exercises/NN_*.ipynb`` from ``solutions/NN_*.ipynb`` (the single source).

In a solution notebook, each answer sits between marker lines::

    def topk_route(scores, k):
        \"\"\"Docstring and hints stay.\"\"\"
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

The exercise keeps everything outside the markers and replaces each region by one line,
``raise NotImplementedError(...)``, at the indentation of the ``BEGIN`` marker. Outputs, execution counts
and execution metadata are cleared, and the kernelspec is the one JupyterLab writes (so an exercise opens
unmodified).
"""

from __future__ import annotations

import difflib
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("exercise: replace this line with your code")'
# What JupyterLab (ipykernel) stores for a Python 3 notebook; every notebook of the course carries it.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


class MarkerError(ValueError):
    """A solution region is unbalanced (BEGIN without END, END without BEGIN, or nested)."""


def stub_source(source: str, where: str) -> str:
    """Replace every BEGIN/END region in one cell's source with the stub line."""
    out: list[str] = []
    inside = False
    for number, line in enumerate(source.split("\n"), start=1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise MarkerError(f"{where}, line {number}: nested '{BEGIN}'")
            inside = True
            out.append(line[: len(line) - len(line.lstrip())] + STUB)
        elif marker == END:
            if not inside:
                raise MarkerError(f"{where}, line {number}: '{END}' without a '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{where}: '{BEGIN}' is never closed by '{END}'")
    return "\n".join(out)


def exercise_notebook(solution: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The exercise version of a solutions notebook: regions stubbed, outputs and counts cleared."""
    nb = nbformat.from_dict(solution)
    nb.metadata.pop("widgets", None)
    nb.metadata.kernelspec = dict(KERNELSPEC)
    for index, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            if BEGIN in cell.source or END in cell.source:
                raise MarkerError(f"{name}, cell {index}: solution markers outside a code cell")
            continue
        cell.source = stub_source(cell.source, f"{name}, cell {index}")
        cell.outputs = []
        cell.execution_count = None
    return nb


def _render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def build(root: Path, check_only: bool = False) -> list[str]:
    """Regenerate ``root/exercises`` from ``root/solutions``.

    Returns the problems found: with ``check_only``, a unified diff per stale or missing exercise (and
    exercises with no solution); otherwise the files are (re)written and the list is empty.
    Raises :class:`MarkerError` for unbalanced markers.
    """
    solutions, exercises = Path(root) / "solutions", Path(root) / "exercises"
    if not solutions.is_dir():
        raise FileNotFoundError(f"root: no solutions/ folder under {root}")
    problems: list[str] = []
    expected_names = set()
    for path in sorted(solutions.glob("[0-9][0-9]_*.ipynb")):
        expected_names.add(path.name)
        text = _render(exercise_notebook(nbformat.read(path, as_version=4), path.name))
        target = exercises / path.name
        current = target.read_text() if target.exists() else ""
        if current == text:
            continue
        if check_only:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), f"committed/{target.name}",
                                        f"regenerated/{target.name}", lineterm="", n=1)
            problems.append("\n".join(list(diff)[:40]))
        else:
            exercises.mkdir(exist_ok=True)
            target.write_text(text)
    for orphan in sorted(exercises.glob("[0-9][0-9]_*.ipynb")):
        if orphan.name not in expected_names:
            problems.append(f"exercises/{orphan.name} has no solutions/{orphan.name}")
    return problems
