"""One input validator for every linear-attention op (recurrent and chunked, GDN and KDA).

Layouts (fla's): q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; log-decay g ``[B, T, H]`` (scalar gate)
or ``[B, T, H, K]`` (channel gate), already activated, so g ≤ 0; beta ``[B, T, H]`` after the sigmoid, in
[0, 1] (or [0, 2] with negative eigenvalues allowed); initial state ``[B, H, K, V]``.

Value checks (NaN or inf, g > 0, beta out of range) read values back to the host, so they run only under
the debug switch (:func:`k3course.debug.value_checks` or ``K3COURSE_DEBUG=1``); shape, dtype and device checks
always run. Documented handling: non-contiguous tensors are accepted (the ops only reshape copies); every tensor must
share one floating dtype (the initial state may instead be float32: the recurrent state is kept in
float32, as in fla, or float64 for float64 inputs; so may the gates g and beta, which autocast computes in
float32) and one device, otherwise a ``TypeError`` / ``ValueError``
names the argument.
"""

from __future__ import annotations

import contextlib
import math

import torch

from k3course import debug
from k3course.guards import is_number


def _require_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _require_finite(name: str, x: torch.Tensor) -> None:
    # one cheap pass (a NaN or inf makes the sum non-finite); the exact check runs only if the sum is not
    if not torch.isfinite(x.sum()) and not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf")


def _check_shapes(q, k, v, g, beta, gate: str, initial_state) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K] (4 dims), got shape {tuple(q.shape)}")
    batch, time, heads, key_dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)} ([B, T, H, K]), got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{batch}, {time}, {heads}, V], got {tuple(v.shape)}")
    if g is not None:
        want = (batch, time, heads) if gate == "scalar" else (batch, time, heads, key_dim)
        layout = "[B, T, H]" if gate == "scalar" else "[B, T, H, K]"
        if tuple(g.shape) != want:
            raise ValueError(f"g must be {layout} = {list(want)} for a {gate} gate, got {tuple(g.shape)}")
    if beta is not None and tuple(beta.shape) != (batch, time, heads):
        raise ValueError(f"beta must be [B, T, H] = {[batch, time, heads]}, got {tuple(beta.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (batch, heads, key_dim, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = {[batch, heads, key_dim, v.shape[-1]]}, "
                         f"got {tuple(initial_state.shape)}")


def _check_values(named: dict, g, beta, allow_neg_eigval: bool) -> None:
    """The checks that read values (host syncs): finite inputs, g ≤ 0, beta in [0, 1] (or [0, 2])."""
    for name, x in named.items():
        _require_finite(name, x)
    if g is not None and (g > 0).any():
        raise ValueError("g is the log-decay log(α) and must be ≤ 0 everywhere (got a positive entry)")
    upper = 2.0 if allow_neg_eigval else 1.0
    if beta is not None and ((beta < 0).any() or (beta > upper).any()):
        raise ValueError(f"beta must lie in [0, {upper:g}] (after the sigmoid"
                         f"{', ×2 with negative eigenvalues' if allow_neg_eigval else ''})")


FLOAT32_ALLOWED = ("g", "beta", "initial_state")  # inputs that may be float32 whatever q's dtype


def float32_recurrence(device: torch.device):
    """A context with autocast off on ``device`` (a no-op when autocast is not on there). The ops compute in
    ``promote_types(q.dtype, float32)`` themselves, so under mixed precision (``k3course train --dtype bfloat16``)
    the recurrence, its products and its state stay float32, as fla's kernels keep them; o is returned in q's
    dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def validate(q, k, v, g=None, beta=None, *, gate: str = "channel", scale=None, initial_state=None,
             allow_neg_eigval: bool = False) -> float:
    """Check the inputs of a linear-attention op and return the scale to use (default ``K ** -0.5``).

    gate: ``"channel"`` (g ``[B, T, H, K]``, KDA/GLA) or ``"scalar"`` (g ``[B, T, H]``, GDN).
    Raises ``TypeError`` (not a tensor, not floating, mixed dtypes) or ``ValueError`` (shapes, device, scale ≤ 0;
    under the debug switch also NaN, g > 0, beta out of range), naming the argument and what was expected.
    """
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}
    named = {name: x for name, x in named.items() if x is not None}
    for name, x in named.items():
        _require_tensor(name, x)
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating tensor, got dtype {q.dtype}")
    for name, x in named.items():
        if x.dtype != q.dtype and not (name in FLOAT32_ALLOWED and x.dtype == torch.float32):
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}: pass one floating dtype for all "
                            "(g, beta and initial_state may also be float32: autocast computes the gates in "
                            "float32, and the state is kept in it)")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}: put all inputs on one device")
    _check_shapes(q, k, v, g, beta, gate, initial_state)
    if debug.enabled():
        _check_values(named, g, beta, allow_neg_eigval)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    return float(scale)


def check_mixer_input(x, d_model: int) -> None:
    """A token mixer's input: a tensor [B, T ≥ 1, d_model] (metadata only, no host read)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != d_model:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [B, T, d_model={d_model}], got {shape}")
    if x.shape[1] == 0:
        raise ValueError("x must hold at least one token (T ≥ 1), got T = 0")


KDA_CHUNK_SIZES = (16, 32, 64)  # the Triton kernels' tiles (16: the smallest tl.dot), so every KDA path takes these


def check_kda_chunk_size(chunk_size) -> None:
    """``chunk_size`` is one of :data:`KDA_CHUNK_SIZES`: what the KDA layer and its Triton kernels accept, the same
    check (and error) on every device."""
    if not is_number(chunk_size) or chunk_size not in KDA_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size!r}")


def check_lower_bound(lower_bound, g: torch.Tensor) -> None:
    """``lower_bound`` is None or a negative finite number; under the debug switch g must respect it."""
    if lower_bound is None:
        return
    if not is_number(lower_bound, int | float) or not -math.inf < lower_bound < 0:
        raise ValueError(f"lower_bound must be None or a negative finite number, got {lower_bound!r}")
    if debug.enabled() and bool((g < lower_bound).any()):
        raise ValueError(f"g has values below lower_bound = {lower_bound}: the gate must satisfy g ≥ lower_bound "
                         "(K3's is lower_bound·σ(·)); pass lower_bound=None for an unbounded gate")
