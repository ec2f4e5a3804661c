"""Triton kernels. The one place that decides native vs interpreter (DESIGN §5).

Triton picks its interpreter when ``@triton.jit`` runs, so the choice is made here, on import of
``k3course.kernels`` and before any kernel module is imported: with no GPU, ``TRITON_INTERPRET=1`` is set
(unless the user already set it). Kernel modules are imported only through this package.
"""

from __future__ import annotations

import importlib.util
import os

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
