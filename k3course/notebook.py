"""Helpers for the lesson notebooks: show the package's source instead of copying it."""

from __future__ import annotations

import inspect

from IPython.display import Code


def show_source(obj) -> Code:
    """Display the source of a package function, class or module, syntax-highlighted."""
    try:
        return Code(inspect.getsource(obj), language="python")
    except TypeError as error:
        raise TypeError(f"obj must be a function, class or module of k3course, got {type(obj).__name__}") from error
