"""Compare a learner's output with the reference's and explain the first difference in at most two lines.

The explanation says where the output is off (structure, shape, dtype, which entries, first bad index) and
how much, only relatively and to an order of magnitude: never the expected values, nor enough to rebuild
them (a zero output learns nothing from its message).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from k3course.guards import is_number

# (rtol, atol) by dtype name; integers and booleans must match exactly.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64 if x.is_floating_point() else x.dtype).numpy()
    return np.asarray(x)


def _dtype_name(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return str(x.dtype).removeprefix("torch.")
    if isinstance(x, np.ndarray | np.generic):
        return str(x.dtype)
    return type(x).__name__


def _is_array(x: Any) -> bool:
    return isinstance(x, torch.Tensor | np.ndarray | np.generic)


def _compare_arrays(got: Any, want: Any, where: str, tolerance: dict) -> str | None:
    if type(got) is not type(want) and not (isinstance(got, np.generic) or isinstance(want, np.generic)):
        return f"{where}: expected a {type(want).__name__}, got {describe(got)}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{where}: shape {tuple(got.shape)} but expected shape {tuple(want.shape)}"
    if _dtype_name(got) != _dtype_name(want):
        return f"{where}: dtype {_dtype_name(got)} but expected dtype {_dtype_name(want)}"
    g, w = _as_numpy(got), _as_numpy(want)
    if g.size == 0:
        return None
    if not np.issubdtype(w.dtype, np.floating):
        bad = np.argwhere(g != w)
        if len(bad) == 0:
            return None
        return (f"{where}: {len(bad)} of {w.size} entries differ (exact match needed for {_dtype_name(want)})\n"
                f"  first bad index {tuple(int(i) for i in bad[0])}")
    rtol, atol = tolerance.get(_dtype_name(want), TOLERANCES.get(_dtype_name(want), (1e-5, 1e-8)))
    for bad_value, test in (("NaN", np.isnan), ("inf", np.isinf)):
        if test(g).any() and not test(w).any():
            first = tuple(int(i) for i in np.argwhere(test(g))[0])
            return f"{where}: contains {bad_value} (first at index {first}); the reference has none"
    err = np.abs(g - w)
    bad_mask = ~(err <= atol + rtol * np.abs(w)) & ~(np.isnan(g) & np.isnan(w))
    if not bad_mask.any():
        return None
    first = tuple(int(i) for i in np.argwhere(bad_mask)[0])
    finite = np.isfinite(w) & np.isfinite(g)
    relative = np.linalg.norm((g - w)[finite]) / max(np.linalg.norm(w[finite]), 1e-30)
    return (f"{where}: {int(bad_mask.sum())} of {w.size} entries are off (rtol {rtol:g}, atol {atol:g}); "
            f"first at index {first}\n  relative error ||yours - expected|| / ||expected|| {_magnitude(relative)}")


def _magnitude(relative: float) -> str:
    """A relative error as an order of magnitude: '~1e-03', or '50% or more'."""
    if relative >= 0.5:
        return "50% or more (a wrong formula, sign or scale?)"
    return f"~1e{math.floor(math.log10(relative) + 0.5):+03d}" if relative > 0 else "~0"


def _how_far(got: float, want: float) -> str:
    """How far a scalar is off, relatively and in bands, without saying in which direction."""
    relative = abs(got - want) / max(abs(want), 1e-30)
    for limit, band in ((1e-3, "less than 0.1%"), (1e-2, "0.1% to 1%"), (0.1, "1% to 10%"), (1.0, "10% to 100%")):
        if relative < limit:
            return f"off by {band} of the expected value"
    return "off by more than 100% of the expected value"


def describe(x: Any) -> str:
    """A short description of a value's kind, never its contents: 'a Tensor of shape (2, 3)', 'None'."""
    if x is None:
        return "None"
    if _is_array(x):
        return f"a {type(x).__name__} of shape {tuple(x.shape)}"
    name = type(x).__name__
    article = "an" if name[0] in "aeiou" else "a"
    if isinstance(x, tuple | list | dict):
        return f"{article} {name} of {len(x)} items"
    return f"{article} {name}"


def explain_difference(got: Any, want: Any, tolerance: dict | None = None, where: str = "output") -> str | None:
    """None when ``got`` matches ``want`` within tolerance, else a short reason (≤ 2 lines).

    Handles tensors, arrays, Python numbers and (nested) tuples / lists / dicts of them; random generators by their
    state; modules, optimizers and schedulers by their ``state_dict()``.
    """
    tolerance = tolerance or {}
    if _is_array(want):
        if not _is_array(got):
            return f"{where}: expected {describe(want)}, got {describe(got)}"
        return _compare_arrays(got, want, where, tolerance)
    if isinstance(want, tuple | list):
        if not isinstance(got, tuple | list) or len(got) != len(want):
            return f"{where}: expected {describe(want)}, got {describe(got)}"
        for i, (g, w) in enumerate(zip(got, want)):
            reason = explain_difference(g, w, tolerance, f"{where}[{i}]")
            if reason:
                return reason
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            keys = sorted(got) if isinstance(got, dict) else describe(got)
            return f"{where}: expected a dict with keys {sorted(want)}, got {keys}"
        for key in want:
            reason = explain_difference(got[key], want[key], tolerance, f"{where}[{key!r}]")
            if reason:
                return reason
        return None
    if isinstance(want, torch.Generator):
        if not isinstance(got, torch.Generator):
            return f"{where}: expected a Generator, got {describe(got)}"
        if torch.equal(got.get_state(), want.get_state()):
            return None
        return f"{where}: the random generator is in another state (drawn from a different number of times?)"
    if callable(getattr(want, "state_dict", None)):  # a module, an optimizer, a learning-rate scheduler
        if type(got) is not type(want):
            return f"{where}: expected {describe(want)}, got {describe(got)}"
        return explain_difference(got.state_dict(), want.state_dict(), tolerance, f"{where}.state_dict()")
    if want is None:
        return None if got is None else f"{where}: expected None, got {describe(got)}"
    if isinstance(want, bool | int | str):
        if type(got) is not type(want):
            return f"{where}: expected {describe(want)}, got {describe(got)}"
        if got == want:
            return None
        return f"{where}: {_how_far(got, want)}" if is_number(want) and want \
            else f"{where}: not the expected value"
    if isinstance(want, float):
        if not is_number(got, int | float):
            return f"{where}: expected a float, got {describe(got)}"
        rtol, atol = tolerance.get("float64", TOLERANCES["float64"])
        if math.isclose(got, want, rel_tol=rtol, abs_tol=atol):
            return None
        return f"{where}: {_how_far(got, want)}"
    raise TypeError(f"cannot compare outputs of type {type(want).__name__}")
