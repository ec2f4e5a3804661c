"""Where tensors live: CUDA when present, else CPU; how the CPU's freed memory is kept; how a call is timed
(the best of several, on a shared machine); and which machine ran it (:func:`machine`)."""

from __future__ import annotations

import ctypes
import platform
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm


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


def on_cuda(device: torch.device | str | None) -> bool:
    """Whether ``device`` (None: unknown) is a CUDA device."""
    return device is not None and torch.device(device).type == "cuda"


def best_seconds(fn, repeats: int = 5, device: torch.device | str | None = None) -> float:
    """The fastest of ``repeats`` calls of ``fn()``, in seconds: the call least disturbed by other processes.

    On a CUDA ``device`` the GPU is synchronised around each call, so the time covers the kernels, not the launch.
    """
    sync = on_cuda(device)
    times = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def interleaved_best_seconds(calls: dict, rounds: int = 3, device: torch.device | str | None = None) -> dict:
    """The best time of each call over ``rounds`` rounds in which the calls take turns, so that a busy spell of a
    shared machine slows all of them alike rather than whichever ran during it.

    calls: name -> (fn, calls per round). Returns name -> seconds (see :func:`best_seconds`).
    """
    best = dict.fromkeys(calls, float("inf"))
    for _ in tqdm(range(rounds), desc="rounds", leave=False):
        for name, (fn, repeats) in calls.items():
            best[name] = min(best[name], best_seconds(fn, repeats, device))
    return best


def machine() -> str:
    """The CPU and the kernel set ATen dispatches to, e.g. "AMD EPYC / AVX2": float sums depend on both."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return f"{names[0] if names else platform.processor() or platform.machine()} / " \
           f"{torch.backends.cpu.get_cpu_capability()}"
