"""Benchmarks, one module per topic, each with ``main(options: list[str]) -> int``; run as
``k3course bench <module>``. They print times measured in one run and ratios between them."""

from __future__ import annotations

import importlib.util
import time

import torch
from tqdm.auto import tqdm

from k3course.device import keep_freed_memory


def best_seconds(fn, repeats: int = 5, device: torch.device | str | None = None) -> float:
    """The fastest of ``repeats`` calls of ``fn()``, in seconds: the call least disturbed by other processes.

    On a CUDA ``device`` the GPU is synchronised around each call, so the time covers the kernels, not the launch.
    """
    sync = torch.device(device).type == "cuda" if device is not None else False
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


def page_faults_per_call(fn, calls: int = 2) -> float | None:
    """Minor page faults per call of ``fn()``, over ``calls`` calls after one to warm up: pages of fresh memory
    the OS maps in on first touch. On a VM that returns freed pages to its host, each costs microseconds, which
    can weigh on an op that allocates large temporaries more than its arithmetic does. None where the platform
    does not count them (no ``resource`` module)."""
    if importlib.util.find_spec("resource") is None:
        return None
    import resource

    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def freed_memory_setting(return_freed_memory: bool) -> str:
    """Keep freed memory in the process, as ``k3course train`` does (:func:`~k3course.device.keep_freed_memory`),
    unless ``return_freed_memory`` asks for glibc's default; returns the setting in words, for the report."""
    if not return_freed_memory and keep_freed_memory():
        return "freed memory kept in the process (as in k3course train)"
    return "freed memory returned to the OS (glibc's default, --return-freed-memory)"
