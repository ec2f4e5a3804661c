"""Where tensors live: CUDA when present, else CPU."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
