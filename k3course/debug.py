"""The debug switch: value checks that read tensors back to the host run only when it is on.

Shape, dtype and device checks are free (they read metadata) and always run. Checks on values (a NaN scan, the
range of a gate, token ids inside the vocabulary) need a device→host read, which stalls a GPU stream at every
call, so the layers never run them in the hot path. Turn them on to find where a bad value first appears::

    with k3course.debug.value_checks():
        model(tokens)

or for a whole process with the environment variable ``K3COURSE_DEBUG=1``.

The layers also name their stages for ``torch.profiler`` with :func:`profiler_range`, a no-op unless a profiler
runs; the benchmarks read those ranges to say where a layer's time goes. Long loops show a text
:func:`progress_bar`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

import torch

_VALUE_CHECKS: ContextVar[bool] = ContextVar("k3course_value_checks",
                                             default=os.environ.get("K3COURSE_DEBUG", "0") == "1")


def enabled() -> bool:
    """Whether value checks run now (inside :func:`value_checks`, or with ``K3COURSE_DEBUG=1``); never inside a
    graph that ``torch.compile`` traces: a host read there would break the graph."""
    return not torch.compiler.is_compiling() and _VALUE_CHECKS.get()


@contextmanager
def value_checks(on: bool = True) -> Iterator[None]:
    """Run the ops' and layers' value checks (NaN scans, range checks) inside this block (``on=False``: skip)."""
    token = _VALUE_CHECKS.set(bool(on))
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def profiler_range(name: str) -> AbstractContextManager:
    """A named range of ``torch.profiler`` (``record_function(name)``) while a profiler runs, else a no-op context.

    Entering a ``record_function`` costs a dispatcher call even with no profiler running, so the layers' hot paths
    check the profiler's flag first. Outputs are the same either way; ``torch.compile`` ignores the ranges.
    """
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return nullcontext()


def progress_bar(iterable=None, **options):
    """A tqdm progress bar drawn as text: on stdout inside a notebook, on stderr in a terminal.

    In a notebook tqdm would draw a widget, and a saved notebook shows a widget's first state ("0/20") to anyone
    who opens it before running the cell; text is saved as it ended ("20/20 [00:08]"). ``options`` go to tqdm.
    """
    from tqdm import tqdm

    in_notebook = "ipykernel" in sys.modules
    options.setdefault("file", sys.stdout if in_notebook else sys.stderr)
    options.setdefault("mininterval", 1.0 if in_notebook else 0.1)
    return tqdm(iterable, **options)
