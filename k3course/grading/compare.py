"""Compare a learner's output with the reference's and explain the first difference in three lines.

The explanation names what differs (structure, shape, dtype, max abs / rel error, first bad index) and never
prints the expected values themselves.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

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
        return f"{where}: expected a {type(want).__name__}, got a {type(got).__name__}"
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
    if np.isnan(g).any() and not np.isnan(w).any():
        first = tuple(int(i) for i in np.argwhere(np.isnan(g))[0])
        return f"{where}: contains NaN (first at index {first}); the reference has none"
    err = np.abs(g - w)
    bad_mask = ~(err <= atol + rtol * np.abs(w)) & ~(np.isnan(g) & np.isnan(w))
    if not bad_mask.any():
        return None
    first = tuple(int(i) for i in np.argwhere(bad_mask)[0])
    rel = np.nanmax(err / np.maximum(np.abs(w), 1e-30))
    return (f"{where}: values differ in {int(bad_mask.sum())} of {w.size} entries\n"
            f"  max abs err {np.nanmax(err):.3g}, max rel err {rel:.3g} (rtol {rtol:g}, atol {atol:g}); "
            f"first bad index {first}")


def explain_difference(got: Any, want: Any, tolerance: dict | None = None, where: str = "output") -> str | None:
    """None when ``got`` matches ``want`` within tolerance, else a short reason (≤ 3 lines).

    Handles tensors, arrays, Python numbers and (nested) tuples / lists / dicts of them.
    """
    tolerance = tolerance or {}
    if _is_array(want):
        if not _is_array(got):
            return f"{where}: expected a {type(want).__name__}, got a {type(got).__name__}"
        return _compare_arrays(got, want, where, tolerance)
    if isinstance(want, tuple | list):
        if not isinstance(got, tuple | list) or len(got) != len(want):
            n = len(got) if isinstance(got, tuple | list) else "a " + type(got).__name__
            return f"{where}: expected a {type(want).__name__} of {len(want)} items, got {n}"
        for i, (g, w) in enumerate(zip(got, want)):
            reason = explain_difference(g, w, tolerance, f"{where}[{i}]")
            if reason:
                return reason
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            return f"{where}: expected a dict with keys {sorted(want)}, got {keys}"
        for key in want:
            reason = explain_difference(got[key], want[key], tolerance, f"{where}[{key!r}]")
            if reason:
                return reason
        return None
    if isinstance(want, bool | int | str) or want is None:
        return None if got == want and type(got) is type(want) else f"{where}: {got!r} is not the expected value"
    if isinstance(want, float):
        if not isinstance(got, int | float) or isinstance(got, bool):
            return f"{where}: expected a float, got a {type(got).__name__}"
        rtol, atol = tolerance.get("float64", TOLERANCES["float64"])
        if math.isclose(got, want, rel_tol=rtol, abs_tol=atol):
            return None
        return f"{where}: {got!r} differs from the expected value by {abs(got - want):.3g}"
    raise TypeError(f"cannot compare outputs of type {type(want).__name__}")
