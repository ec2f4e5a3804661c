"""Triton kernels. The one place that decides native vs interpreter (lesson 08).

Triton makes a kernel compiled or interpreted when ``@triton.jit`` runs (its own ``tl.sum`` & co. when triton is
first imported), so the mode is chosen once per process, before triton loads, by :func:`select_triton_mode` —
where a kernel is first needed, never by importing the package:

- the layers and the MoE dispatch ask :func:`use_triton` when they first run, and import a kernel module only
  when it says yes;
- each kernel module (``basics``, ``kda_chunk``, ``kda_decode``, ``grouped_gemm``) chooses first thing, before
  its own ``import triton``, so importing one directly works on a CPU-only machine too.

The one rule for a notebook (lesson 08 states it): **call** ``k3course.kernels.select_triton_mode()`` **in the
first cell, before anything imports triton** — your own ``@triton.jit`` kernels, fla, transformers' Kimi Linear.
tests/conftest.py does so for the test suite.

Choosing changes no environment variable: on a CPU (triton installed, ``TRITON_INTERPRET`` unset) triton is
imported with ``TRITON_INTERPRET=1`` for that moment only, and Triton's own switch
``triton.knobs.runtime.interpret`` keeps the interpreter on for the rest of the process. A child process starts
unchosen and chooses for itself when it needs a kernel.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import torch

_mode: str | None = None


def select_triton_mode() -> str:
    """Choose Triton's mode once and return it: 'native' (a CUDA GPU), 'interpreter' (``TRITON_INTERPRET=1``:
    CPU tensors, fp32) or 'unavailable' (triton not installed).

    With triton installed, no GPU and ``TRITON_INTERPRET`` unset, this imports triton with its interpreter
    switched on (:func:`_import_triton_interpreted`); ``os.environ`` is left as it was. Later calls return the
    first answer.
    """
    global _mode
    if _mode is None:
        if importlib.util.find_spec("triton") is None:
            _mode = "unavailable"
        elif os.environ.get("TRITON_INTERPRET") == "1":
            _mode = "interpreter"
        elif torch.cuda.is_available():
            _mode = "native"
        else:
            _import_triton_interpreted()
            _mode = "interpreter"
        _warn_if_triton_came_first(_mode)
    return _mode


def _import_triton_interpreted() -> None:
    """Import triton with ``TRITON_INTERPRET=1`` set only while it loads (so its own jit helpers are made
    interpreted), and switch on its interpreter knob, which outlives the variable: every ``@triton.jit`` after
    this is interpreted, and the environment is as it was."""
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        triton.knobs.runtime.interpret = True
    finally:
        del os.environ["TRITON_INTERPRET"]


def __getattr__(name: str):
    """``TRITON_MODE``: the mode :func:`select_triton_mode` chose (reading it chooses it)."""
    if name == "TRITON_MODE":
        return select_triton_mode()
    raise AttributeError(f"module 'k3course.kernels' has no attribute {name!r}")


def _warn_if_triton_came_first(mode: str) -> None:
    """Triton's own helpers (tl.sum, tl.cumsum, ...) are ``@triton.jit`` functions too, made when triton is
    imported: if that happened before TRITON_INTERPRET was set (say ``import fla`` first), they are compiled-mode
    functions and every interpreted kernel that calls them fails. Say so, with the fix."""
    language = sys.modules.get("triton.language")
    if mode != "interpreter" or language is None:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(language.standard.sum, InterpretedFunction):
        warnings.warn("triton was imported before k3course.kernels switched on the interpreter, so Triton kernels "
                      "will fail on this CPU; call k3course.kernels.select_triton_mode() before importing triton "
                      "(or fla), or set TRITON_INTERPRET=1 in the environment", RuntimeWarning, stacklevel=3)


BACKENDS = ("auto", "triton", "torch")


def use_triton(device: torch.device | str, backend: str | None = None) -> bool:
    """Whether a layer on ``device`` should run the Triton kernels (True) or the torch path (False).

    ``backend`` is ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` (always; on CPU the kernels run
    under the interpreter, slowly, in fp32) or ``"torch"`` (never). When ``backend`` is None it is read from the
    environment variable ``K3COURSE_KERNELS`` (default ``"auto"``): the one switch that forces either path.
    """
    chosen = backend if backend is not None else os.environ.get("K3COURSE_KERNELS", "auto")
    if chosen not in BACKENDS:
        raise ValueError(f"backend (or K3COURSE_KERNELS) must be one of {BACKENDS}, got {chosen!r}")
    if chosen == "torch" or (chosen == "auto" and torch.device(device).type != "cuda"):
        return False  # decided without Triton: its mode is chosen only when a kernel could run
    mode = select_triton_mode()
    if mode == "unavailable":
        if chosen == "triton":
            raise RuntimeError("backend 'triton' was forced but triton is not installed")
        return False
    if chosen == "triton":
        return True
    return mode == "native"
