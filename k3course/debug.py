"""The debug switch: value checks that read tensors back to the host run only when it is on.

Shape, dtype and device checks are free (they read metadata) and always run. Checks on values (a NaN scan, the
range of a gate, token ids inside the vocabulary) need a device→host read, which stalls a GPU stream at every
call, so the layers never run them in the hot path. Turn them on to find where a bad value first appears::

    with k3course.debug.value_checks():
        model(tokens)

or for a whole process with the environment variable ``K3COURSE_DEBUG=1``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_VALUE_CHECKS: ContextVar[bool] = ContextVar("k3course_value_checks",
                                             default=os.environ.get("K3COURSE_DEBUG", "0") == "1")


def enabled() -> bool:
    """Whether value checks run now (inside :func:`value_checks`, or with ``K3COURSE_DEBUG=1``)."""
    return _VALUE_CHECKS.get()


@contextmanager
def value_checks(on: bool = True) -> Iterator[None]:
    """Run the ops' and layers' value checks (NaN scans, range checks) inside this block (``on=False``: skip)."""
    token = _VALUE_CHECKS.set(bool(on))
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)
