"""Paths and loaders shared by the tests."""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
_EVENT_IDS = itertools.count()


def notebooks(folder: str) -> list[Path]:
    """The numbered notebooks in ``folder`` (exercises, solutions, notebooks)."""
    return sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb"))


def _wrong_modules() -> list:
    """The modules of ``tests/wrong/*.py``, loaded."""
    modules = []
    for path in sorted((ROOT / "tests" / "wrong").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"wrong_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def wrong_answers() -> dict[str, list]:
    """Plausible wrong implementations, by exercise id, gathered from ``tests/wrong/*.py`` (one module per
    chapter, ``chNN_*.py``, and ``every_exercise.py`` for cheats that apply to every exercise)."""
    merged: dict[str, list] = {}
    for module in _wrong_modules():
        for exercise_id, fns in module.WRONG.items():
            merged.setdefault(exercise_id, []).extend(fns)
    return merged


def pointed_messages() -> dict[str, list[tuple]]:
    """(wrong answer, what its check's message must say), by exercise id: the ``POINTED`` dicts of
    ``tests/wrong/*.py``, for the wrong answers whose step the grader names."""
    pointed: dict[str, list[tuple]] = {}
    for module in _wrong_modules():
        said = getattr(module, "POINTED", {})
        for exercise_id, fns in module.WRONG.items():
            pointed.setdefault(exercise_id, []).extend((fn, said[fn]) for fn in fns if fn in said)
    return {exercise_id: pairs for exercise_id, pairs in pointed.items() if pairs}


def profiler_event(name: str, start_us: int, end_us: int, *children, sequence_nr: int = -1):
    """A CPU event of ``torch.profiler`` (its own ``FunctionEvent`` type) spanning [start_us, end_us], parent of
    ``children``: a piece of a recorded trace whose times are known, for testing what reads a profile."""
    from torch.autograd.profiler_util import FunctionEvent

    event = FunctionEvent(id=next(_EVENT_IDS), name=name, thread=0, start_us=start_us, end_us=end_us,
                          sequence_nr=sequence_nr)
    for child in children:
        assert start_us <= child.time_range.start and child.time_range.end <= end_us, "a child lies inside its parent"
        event.append_cpu_child(child)
        child.set_cpu_parent(event)
    return event


def profiler_events(*roots) -> list:
    """Every event of the trees ``roots``, parents before children: the flat list ``torch.profiler`` gives."""
    return [event for root in roots for event in (root, *profiler_events(*root.cpu_children))]


def devices_computed_on(build) -> tuple[object, set[str]]:
    """(``build()``, the device types of every tensor an op made while it ran): a build on the meta device that
    allocates nothing real shows {"meta"}, whatever the machine's load (no clock involved)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Devices(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen |= {t.device.type for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
            return out

    with Devices() as mode:
        built = build()
    return built, mode.seen


class HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` calls made while active (``.item()``, ``float(t)``, ``bool(t)``: each
    stalls a GPU's stream), except reads of the tensors ``ignored(tensor)`` names."""

    def __init__(self, ignored: Callable[[torch.Tensor], bool] = lambda tensor: False):
        super().__init__()
        self.count, self.ignored = 0, ignored

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default and not self.ignored(args[0])
        return func(*args, **(kwargs or {}))
