"""Refuse the package's own answer: an answer may not call the package function its exercise asks for.

While a learner's answer runs, a profile hook on its thread (``sys.setprofile``) sees every Python function call.
A call of a refused function's code, matched by its file and qualified name, is refused whoever makes it: the
learner directly, through any import path or re-export (``k3course.ops.kda_step``), through a reloaded module, or
through another package function that calls it inside (``kda_recurrent`` runs ``kda_step``). The hook raises at
the first such call and remembers it, so an answer that catches the error still fails.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


class PackageAnswer(Exception):
    """The learner's answer called the package's implementation of the exercise it answers."""


@dataclass(frozen=True)
class PackageRule:
    """The refused functions' code, as {(file, qualified name): dotted name}, and what the exercise allows."""

    code: dict[tuple[str, str], str]
    may_use: tuple[str, ...] = ()

    def message(self, name: str) -> str:
        allowed = (f"from k3course you may call {', '.join(self.may_use)}" if self.may_use
                   else "from k3course you may call the functions of earlier exercises")
        return (f"your function called the package's own {name}, the answer to this exercise: write it yourself "
                f"with torch ({allowed})")


def _code(function: Callable[..., Any]):
    """The code object a call of ``function`` runs (through decorators' ``__wrapped__``, methods' ``__func__``);
    None for a built-in (torch's own ``torch.square``: no package code to refuse)."""
    function = inspect.unwrap(getattr(function, "__func__", function))
    return getattr(function, "__code__", None)


def package_rule(functions: tuple[Callable[..., Any], ...], may_use: tuple[str, ...] = ()) -> PackageRule:
    """The rule refusing calls of ``functions`` (each matched by its code's file, real path too, and qualname)."""
    code = {}
    for function in functions:
        compiled = _code(function)
        if compiled is None:
            continue
        name = f"{function.__module__}.{compiled.co_qualname}"
        for file in {compiled.co_filename, os.path.realpath(compiled.co_filename)}:
            code[file, compiled.co_qualname] = name
    return PackageRule(code, tuple(may_use))


@contextmanager
def refusing_package(rule: PackageRule | None) -> Iterator[list[str]]:
    """Within the block, on this thread, a call of ``rule``'s functions raises :class:`PackageAnswer`; yields the
    list of the refused calls' names (checked after the block, in case the answer caught the error)."""
    refused: list[str] = []
    if rule is None:
        yield refused
        return

    def hook(frame, event, arg):
        if event == "call":
            name = rule.code.get((frame.f_code.co_filename, frame.f_code.co_qualname))
            if name is not None:
                refused.append(name)
                raise PackageAnswer(rule.message(name))

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield refused
    finally:
        sys.setprofile(previous)
