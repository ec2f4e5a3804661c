"""What ``k3course progress`` and a failing ``pytest --nbval`` report print: the table of exercises and the name
JupyterLab gives a code cell after Restart Kernel and Run All Cells."""

from __future__ import annotations


def run_all_label(position: int, stopped_at: int | None) -> str:
    """How JupyterLab names the code cell at ``position`` (code cells counted from 1) after Kernel > Restart Kernel
    and Run All Cells, which stops at the first cell that raises (the code cell at ``stopped_at``; None when none
    raises): ``[position]``, its execution count, for the cells Run All ran; for a cell after the stop, which Run All
    never ran and so shows no number, its position and where Run All stopped."""
    if position < 1:
        raise ValueError(f"position: code cells count from 1, got {position}")
    if stopped_at is None or position <= stopped_at:
        return f"[{position}]"
    return f"code cell {position} (Run All stops before it, at the error in [{stopped_at}])"


def progress_table(rows: list[tuple[str, str, str]]) -> list[str]:
    """The lines of ``k3course progress``'s table: a header, then one line per (notebook, exercise id, status)
    row; the notebook and exercise columns padded to their longest entry (header included), two spaces apart."""
    table = [("notebook", "exercise", "status"), *rows]
    widths = [max(len(row[column]) for row in table) for column in range(2)]
    return [f"{name:<{widths[0]}}  {exercise_id:<{widths[1]}}  {status}" for name, exercise_id, status in table]
