"""Paths and loaders shared by the tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def notebooks(folder: str) -> list[Path]:
    """The numbered notebooks in ``folder`` (exercises, solutions, notebooks)."""
    return sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb"))


def wrong_answers() -> dict[str, list]:
    """Plausible wrong implementations, by exercise id, gathered from ``tests/wrong/*.py`` (one module per
    chapter, ``chNN_*.py``, and ``every_exercise.py`` for cheats that apply to every exercise)."""
    merged: dict[str, list] = {}
    for path in sorted((ROOT / "tests" / "wrong").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"wrong_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for exercise_id, fns in module.WRONG.items():
            merged.setdefault(exercise_id, []).extend(fns)
    return merged
