"""The markers a lesson's markdown quotes numbers under: the registry of quoted functions, the parser and the check
(see :mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass

MARKER = re.compile(r"<!--q:(?P<body>.*?)-->", re.S)
QUOTED: dict[str, Callable] = {}
CONTEXT_1M = 1 << 20  # the lessons' "1M tokens": 2^20 = 1,048,576, Kimi K3's context length (not 10^6)


def quoted(function: Callable) -> Callable:
    """Register ``function`` under its own name: markdown quotes it as ``<!--q:name(args)|fmt-->``."""
    if function.__name__ in QUOTED:
        raise ValueError(f"function: {function.__name__!r} is registered twice")
    QUOTED[function.__name__] = function
    return function


@dataclass(frozen=True)
class Pair:
    """Two numbers written in one format with a separator between them: ``mean ± std`` (:func:`plus_minus`) or
    ``low–high`` (:func:`span`)."""

    first: float
    second: float
    separator: str

    def __format__(self, spec: str) -> str:
        return f"{self.first:{spec}}{self.separator}{self.second:{spec}}"


def plus_minus(mean: float, std: float) -> Pair:
    """``mean ± std``."""
    return Pair(mean, std, " ± ")


def span(low: float, high: float) -> Pair:
    """``low–high``."""
    return Pair(low, high, "–")


# --- markers: parse, evaluate, compare ----------------------------------------------------------------------

@dataclass(frozen=True)
class Mismatch:
    """A marker whose text is not its computation: ``marker`` as written, ``expected`` (formatted), ``found``
    (the text after the marker, as long as ``expected``), or ``error`` when the marker cannot be evaluated."""

    marker: str
    expected: str
    found: str
    error: str = ""

    def __str__(self) -> str:
        if self.error:
            return f"{self.marker}: {self.error}"
        return f"{self.marker} computes {self.expected!r} but the text says {self.found!r}"


def evaluate(body: str) -> str:
    """The text a marker's ``NAME(ARGS)|FMT`` stands for: the registered function's value, formatted."""
    call, _, spec = body.rpartition("|") if "|" in body else (body, "", "")
    tree = ast.parse(call.strip(), mode="eval").body
    if isinstance(tree, ast.Name):
        name, args = tree.id, ()
    elif isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and not tree.keywords:
        name, args = tree.func.id, tuple(ast.literal_eval(arg) for arg in tree.args)
    else:
        raise ValueError(f"a marker is NAME or NAME(literal, ...), got {call!r}")
    if name not in QUOTED:
        raise KeyError(f"no quoted number named {name!r} in k3course.lessons.quoted")
    return format(QUOTED[name](*args), spec)


def normalise(text: str) -> str:
    """Typography that does not change a number: the minus sign, thin and no-break spaces."""
    return text.replace("−", "-").replace("\u2009", " ").replace("\u202f", " ").replace("\xa0", " ")


def check_text(text: str) -> tuple[int, list[Mismatch]]:
    """(markers found, the ones whose text is not their computation) in a markdown ``text``.

    The text right after a marker must start with the formatted value and not continue it with another digit
    (``3.9`` does not match ``3.94``)."""
    mismatches, count = [], 0
    for match in MARKER.finditer(text):
        count += 1
        try:
            expected = normalise(evaluate(match["body"]))
        except Exception as error:  # noqa: BLE001 - any failure to evaluate is reported as a mismatch
            mismatches.append(Mismatch(match[0], "", "", f"{type(error).__name__}: {error}"))
            continue
        after = normalise(text[match.end():])
        found = after[:len(expected)]
        continues = after[len(expected):len(expected) + 2]
        if found != expected or re.match(r"\d|[.,]\d", continues):
            mismatches.append(Mismatch(match[0], expected, after[:len(expected) + 2]))
    return count, mismatches


def say(template: str, **values) -> None:
    """Show ``template`` (markdown) with ``values`` filled in, as a cell's output: a sentence about numbers this
    run computed (``say("GDN recalls {acc:.0%}", acc=0.95)``)."""
    from IPython.display import Markdown, display

    display(Markdown(template.format(**values)))
