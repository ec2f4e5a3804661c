"""Execute a notebook and report, cell by cell, which check cells pass, are not done, or fail.

Used by ``k3course progress`` and by the grading-contract tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

CHECK_CALL = re.compile(r"""\bcheck\(\s*["']([^"']+)["']""")


@dataclass(frozen=True)
class CellResult:
    """What one code cell did: its index, the exercise ids it checks, and its error (if any)."""

    index: int
    exercise_ids: tuple[str, ...]
    error_name: str | None
    error_value: str | None

    @property
    def is_check(self) -> bool:
        return bool(self.exercise_ids)

    @property
    def status(self) -> str:
        """'done', 'not done' (ExerciseNotDone) or 'failing' (any other error)."""
        if self.error_name is None:
            return "done"
        return "not done" if self.error_name == "ExerciseNotDone" else "failing"


class _CurrentInterpreter(KernelSpecManager):
    """Kernel specs that always run this interpreter, so a notebook sees the same installed k3course."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        return KernelSpec(argv=argv, display_name="Python (current)", language="python", resource_dir="")


def check_ids(source: str) -> tuple[str, ...]:
    """The exercise ids that a cell's source passes to ``check``."""
    return tuple(CHECK_CALL.findall(source))


def execute(path: Path, timeout: int = 600) -> tuple[nbformat.NotebookNode, list[CellResult]]:
    """Run the notebook at ``path`` top to bottom (errors don't stop it); return it and one result per cell.

    The kernel process's own stderr (import-time warnings from native libraries) is discarded so that it
    doesn't interleave with the caller's output; what the cells print, warnings included, is in the outputs.
    The kernel is shut down when the run ends, however it ends (nbclient shuts down only kernels whose manager it
    created itself, and this one is ours).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no notebook at {path}")
    nb = nbformat.read(path, as_version=4)
    kernel = KernelManager(kernel_name="python3", kernel_spec_manager=_CurrentInterpreter())
    client = NotebookClient(nb, km=kernel, timeout=timeout, allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute(stderr=subprocess.DEVNULL)
    finally:
        if kernel.has_kernel:
            kernel.shutdown_kernel(now=True)
    results = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        error = next((out for out in cell.get("outputs", []) if out.output_type == "error"), None)
        results.append(CellResult(index, check_ids(cell.source), error and error.ename, error and error.evalue))
    return nb, results


def first_error_position(results: list[CellResult]) -> int | None:
    """The position (from 1) of the first code cell that raised, where Run All stops; None when none raised."""
    return next((number for number, cell in enumerate(results, 1) if cell.error_name is not None), None)

