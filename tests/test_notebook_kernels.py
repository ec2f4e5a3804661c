"""grading.notebooks.execute shuts down the kernel it starts: the suite runs dozens of notebooks through it, and a
kernel left behind per notebook is a Python process holding its imports (hundreds of MiB each)."""

from __future__ import annotations

import os

import nbformat

from k3course.grading.notebooks import execute


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_every_kernel_execute_starts_is_gone_after_it(tmp_path):
    """Two notebooks, one of them failing in a cell: each cell prints its kernel's pid; afterwards none is alive."""
    pids = []
    for name, source in (("fine", "import os; print(os.getpid())"), ("failing", "import os; print(os.getpid())\n1/0")):
        path = tmp_path / f"{name}.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), path)
        nb, results = execute(path, timeout=120)
        pids.append(int(nb.cells[0].outputs[0].text.split()[0]))
        assert (results[0].error_name is None) == (name == "fine")
    assert all(pid != os.getpid() for pid in pids)
    assert [pid for pid in pids if _alive(pid)] == [], "a kernel started by execute is still running"
