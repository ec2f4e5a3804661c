"""The one number guard every argument check uses (the package's lowest floor: it imports nothing of k3course).

Python's ``bool`` is an ``int`` (``True + True == 2``), so ``isinstance(True, int)`` holds: a check for "an int"
that forgets this accepts ``steps=True`` as one step. :func:`is_number` is that check, said once.
"""

from __future__ import annotations


def is_number(value, kind: type | tuple[type, ...] = int) -> bool:
    """Whether ``value`` is an instance of ``kind`` (default ``int``; ``int | float`` for a real number; numpy's
    scalar types where a caller accepts them) and not a ``bool``. The caller checks the range and names the
    argument in its error."""
    return isinstance(value, kind) and not isinstance(value, bool)
