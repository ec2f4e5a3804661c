"""The numbers the lessons quote in their text, each computed by the package: where a sentence's number comes from.

A number in a lesson's markdown that comes from a computation stays literal text, right after an invisible
marker (an HTML comment: JupyterLab and GitHub do not show it) that names the computation:

    at 1M tokens the hybrid holds <!--q:k3_cache_gib(1048576)|.1f-->27.4 GiB per sequence

``NAME(ARGS)`` calls the function registered here as ``NAME`` with literal arguments (no arguments: ``NAME``
alone); ``|FMT`` formats the value with Python's format spec (a :class:`Pair` formats both
of its numbers). :func:`check_text` finds every marker in a text and reports each one whose text does not begin
with the formatted value; ``tests/test_quoted_numbers.py`` runs it over every lesson, solution and exercise
notebook and the README. Change a formula, a preset or a saved result and the sentence that quotes it fails.

Numbers a notebook measures or trains while it runs (times, a live training's accuracies) change from machine to
machine: the lessons do not write them into markdown. A cell prints them, or renders its sentence from them
with :func:`say`.

Memory is counted in binary units throughout the course (KiB, MiB, GiB = 2¹⁰, 2²⁰, 2³⁰ bytes); rates
(bandwidths, FLOP/s) in decimal ones (GB/s, TFLOP/s), as hardware is sold.

Where things are: the markers (registry, parser, check, :func:`say`) in :mod:`~k3course.lessons.quoted.markers`;
the numbers one module per chapter — ``size`` (00, README), ``moe`` (02, 03), ``recall`` (05), ``mla`` (09),
``decoding`` (00, 09, 14), ``assembled_model`` (11), ``claims`` (12), ``ch12_mqar`` (12 §6.3), ``expert_parallel``
(13), ``released_checkpoint`` (15), ``serving`` (14 §12), ``tuning`` (12: the learning-rate grid and choices).
Importing this package registers them all; ``quoted.NAME``
is the number ``NAME`` wherever its chapter defines it.
"""

from __future__ import annotations

# the chapters' modules register their functions in QUOTED when imported
from k3course.lessons.quoted import (  # noqa: F401
    assembled_model,
    ch12_mqar,
    claims,
    decoding,
    expert_parallel,
    mla,
    moe,
    recall,
    released_checkpoint,
    serving,
    size,
    tuning,
)
from k3course.lessons.quoted.markers import (
    CONTEXT_1M,
    MARKER,
    QUOTED,
    Mismatch,
    Pair,
    check_text,
    evaluate,
    normalise,
    plus_minus,
    quoted,
    say,
    span,
)

__all__ = ["CONTEXT_1M", "MARKER", "QUOTED", "Mismatch", "Pair", "check_text", "evaluate", "normalise", "plus_minus",
           "quoted", "say", "span"]


def __getattr__(name: str):
    """``quoted.NAME`` for every registered number (``quoted.active_params_b()``), wherever its chapter defines it."""
    if name in QUOTED:
        return QUOTED[name]
    raise AttributeError(f"module 'k3course.lessons.quoted' has no attribute {name!r}")
