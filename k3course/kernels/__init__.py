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


# The one kernel switch, chosen once when a model (or a layer) is built and read by every dispatch in it:
#   auto    Triton on CUDA (native Triton), torch elsewhere; the experts' grouped GEMM: Triton on CUDA, else
#           torch._grouped_mm where it has its fast path (CUDA sm90+, bf16), else one matmul per expert
#   triton  always Triton (on a CPU under the interpreter, slowly, fp32)
#   torch   torch's ops: the KDA ops of chapters 03-07, torch._grouped_mm for the experts
#   loop    torch's ops, the experts one matmul each (chapter 01)
BACKENDS = ("auto", "triton", "torch", "loop")


def kernel_backend(backend: str | None = None) -> str:
    """The kernel backend a model is built with: ``backend``, or when None the environment variable
    ``K3COURSE_KERNELS`` (default ``"auto"``), checked against :data:`BACKENDS`. Read once, at the build."""
    chosen = backend if backend is not None else os.environ.get("K3COURSE_KERNELS", "auto")
    if chosen not in BACKENDS:
        source = "kernels" if backend is not None else "K3COURSE_KERNELS"
        raise ValueError(f"{source} must be one of {BACKENDS}, got {chosen!r}")
    return chosen


def use_triton(device: torch.device | str, backend: str) -> bool:
    """Whether a layer on ``device`` built with the kernel ``backend`` (:func:`kernel_backend`) runs the Triton
    kernels (True) or torch (False): "auto" on CUDA with native Triton, "triton" always, "torch" / "loop" never."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    chosen = backend
    if chosen in ("torch", "loop") or (chosen == "auto" and torch.device(device).type != "cuda"):
        return False  # decided without Triton: its mode is chosen only when a kernel could run
    mode = select_triton_mode()
    if mode == "unavailable":
        if chosen == "triton":
            raise RuntimeError("backend 'triton' was forced but triton is not installed")
        return False
    if chosen == "triton":
        return True
    return mode == "native"
