"""Triton kernels. The one place that decides native vs interpreter (DESIGN §5).

Triton picks its interpreter when ``@triton.jit`` runs, so the choice is made here, on import of
``k3course.kernels`` and before any kernel module is imported: with no GPU, ``TRITON_INTERPRET=1`` is set
(unless the user already set it). Kernel modules are imported only through this package.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import torch


def _choose_mode() -> str:
    if importlib.util.find_spec("triton") is None:
        return "unavailable"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreter"
    if torch.cuda.is_available():
        return "native"
    os.environ["TRITON_INTERPRET"] = "1"
    return "interpreter"


TRITON_MODE: str = _choose_mode()
"""'native' (compiled for the GPU), 'interpreter' (TRITON_INTERPRET=1, CPU tensors, fp32) or 'unavailable'."""



def _warn_if_triton_came_first() -> None:
    """Triton's own helpers (tl.sum, tl.cumsum, ...) are ``@triton.jit`` functions too, made when triton is
    imported: if that happened before TRITON_INTERPRET was set (say ``import fla`` before ``import k3course``),
    they are compiled-mode functions and every interpreted kernel that calls them fails. Say so, with the fix."""
    language = sys.modules.get("triton.language")
    if TRITON_MODE != "interpreter" or language is None:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(language.standard.sum, InterpretedFunction):
        warnings.warn("triton was imported before k3course.kernels switched on the interpreter, so Triton kernels "
                      "will fail on this CPU; import k3course.kernels before triton (or fla), or set "
                      "TRITON_INTERPRET=1 in the environment", RuntimeWarning, stacklevel=2)


_warn_if_triton_came_first()

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
    if chosen == "torch":
        return False
    if TRITON_MODE == "unavailable":
        if chosen == "triton":
            raise RuntimeError("backend 'triton' was forced but triton is not installed")
        return False
    if chosen == "triton":
        return True
    return torch.device(device).type == "cuda" and TRITON_MODE == "native"
