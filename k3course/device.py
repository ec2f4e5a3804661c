"""Where tensors live: CUDA when present, else CPU; and how the CPU's freed memory is kept."""

from __future__ import annotations

import ctypes

import torch


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory in the process (never trim the heap, serve blocks up to 32 MB, its
    largest setting, from the heap instead of fresh mappings), as torch's CUDA caching allocator does on a GPU:
    freed tensors are then reused without page faults. By default glibc returns large freed blocks to the OS,
    and every step maps its temporaries in again, page by page (on a VM that hands freed pages back to its host,
    a few microseconds each; ``k3course bench moe`` prints the page faults per call).
    Process-wide; ``k3course train``, ``experiments`` and ``bench kda`` / ``bench moe`` call it. The process
    keeps its peak memory. Returns False where the C library is not glibc (nothing is changed there)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
