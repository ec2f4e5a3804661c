"""Refuse named torch functions while a learner's answer runs ("don't call a solver", "write it in Triton").

A :class:`torch.overrides.TorchFunctionMode` sees every torch function and tensor method call. A call is
refused when its name is forbidden and the code that made it is the learner's: frames inside torch and Triton
(the interpreter moves tensors with torch) and the grader's are looked through, so only the learner's own
calls count.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from k3course.grading.registry import Forbidden


class ForbiddenCall(Exception):
    """The learner's code called a torch function that the exercise rules out."""


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are looked through to find who made a call: torch's and Triton's (when installed)."""
    try:
        import triton
    except ImportError:
        return (_package_dir(torch),)
    return _package_dir(torch), _package_dir(triton)


GRADER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _called_by_learner(library_dirs: tuple[str, ...], made_in: tuple[str, ...]) -> bool:
    """Whether the code that made the call, looking through torch's and Triton's frames, is not the grader's (and,
    when ``made_in`` names modules, whether one of the frames looked through is in one of them)."""
    frame, through = sys._getframe(2), []
    while frame is not None and frame.f_code.co_filename.startswith(library_dirs):
        through.append(frame.f_code.co_filename)
        frame = frame.f_back
    made_there = not made_in or any(part in file for file in through for part in made_in)
    return made_there and frame is not None and not frame.f_code.co_filename.startswith(GRADER_DIR)


def _name(func) -> str:
    """A torch function's plain name: ``torch.linalg.inv`` -> 'inv', ``Tensor.add_`` -> 'add', ``__rsub__``
    -> 'rsub'."""
    name = (getattr(func, "__name__", "") or type(func).__name__).strip("_")
    return name.removeprefix("linalg_")


class _Refuse(TorchFunctionMode):
    """Raise :class:`ForbiddenCall` when the learner calls a function named in ``rule.names``."""

    def __init__(self, rule: Forbidden):
        super().__init__()
        self.rule, self.library_dirs = rule, _library_dirs()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        refused = self.rule.every_call or name in self.rule.names
        if refused and _called_by_learner(self.library_dirs, self.rule.made_in):
            raise ForbiddenCall(f"your code called {name}: {self.rule.why}")
        return func(*args, **(kwargs or {}))


@contextmanager
def refusing(rule: Forbidden | None):
    """Within the block, the learner's calls of ``rule``'s functions raise :class:`ForbiddenCall`."""
    if rule is None:
        yield
        return
    with _Refuse(rule):
        yield
