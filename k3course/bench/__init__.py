"""Benchmarks, one module per topic, each with ``main(options: list[str]) -> int``; run as
``k3course bench <module>``. They print times measured in one run and ratios between them.

Shared here: the page faults per call, the options every benchmark takes (:func:`add_options`,
:func:`apply_options`: threads, the allocator setting, repeats, rounds) and the reading of a layer's named profiler
ranges (:func:`profile_calls`, :func:`range_seconds`), so that a stage breakdown times the real layer rather than
a copy of its forward. The timing itself (best of several calls, interleaved rounds) is
:func:`k3course.device.best_seconds` and :func:`k3course.device.interleaved_best_seconds`.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
from torch.profiler import ProfilerActivity, profile

from k3course.device import keep_freed_memory, on_cuda


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


def _at_least(minimum: int):
    """An argparse type: an int ≥ ``minimum`` (argparse names the option in its error)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {value}")
        return value
    parse.__name__ = f"int >= {minimum}"
    return parse


def add_options(parser: argparse.ArgumentParser, *, threads: int, repeats: int | None = None,
                rounds: int | None = None) -> None:
    """Add the options every benchmark shares to ``parser``, with that benchmark's defaults (given explicitly):

    ``--threads`` (torch CPU threads; 0: torch's default) and ``--return-freed-memory`` (the allocator setting,
    see :func:`freed_memory_setting`) always; ``--repeats`` (timed calls per measurement, the best reported) and
    ``--rounds`` (rounds in which the variants take turns, see :func:`interleaved_best_seconds`) when the benchmark
    gives a default for them. :func:`apply_options` applies them.
    """
    parser.add_argument("--threads", type=_at_least(0), default=threads,
                        help=f"torch CPU threads (0: torch's default; default {threads})")
    parser.add_argument("--return-freed-memory", action="store_true",
                        help="leave glibc's default: freed memory goes back to the OS and is faulted in anew "
                             "(by default it is kept in the process, as in k3course train)")
    if repeats is not None:
        parser.add_argument("--repeats", type=_at_least(1), default=repeats,
                            help=f"timed calls per measurement, the best reported (default {repeats})")
    if rounds is not None:
        parser.add_argument("--rounds", type=_at_least(1), default=rounds,
                            help=f"rounds, each timing every variant in turn (default {rounds})")


def apply_options(threads: int, return_freed_memory: bool) -> str:
    """Apply the shared options to this process (``torch.set_num_threads`` unless 0, the allocator setting) and
    return them in words, for the benchmark to print: "2 CPU thread(s); freed memory kept in the process ..."."""
    if threads:
        torch.set_num_threads(threads)
    return f"{torch.get_num_threads()} CPU thread(s); {freed_memory_setting(return_freed_memory)}"


def profile_calls(fn, calls: int, device: torch.device | str | None = None) -> tuple[list, float]:
    """Run ``fn()`` ``calls`` times under ``torch.profiler`` (CPU, plus CUDA on a CUDA ``device``). Returns (the
    profiler's events, seconds per call while profiled): what :func:`range_seconds` reads."""
    cuda = on_cuda(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / calls
    return list(profiler.events()), seconds


BACKWARD_EVENT = "autograd::engine::evaluate_function: "  # the profiler's name of an autograd node's backward


def range_seconds(events: list, prefix: str, calls: int, device: torch.device | str | None = None) -> dict:
    """Seconds per call spent in each profiler range named ``prefix`` + stage (a layer's
    :func:`~k3course.debug.profiler_range`), from the events of :func:`profile_calls` over ``calls`` calls.

    A stage's time is its own: the range's total minus the ranges of the prefix nested inside it, plus, when the
    calls ran a backward, the backward of every autograd node its own part created (matched by the profiler's
    sequence numbers). CPU time, or the kernels' time on a CUDA ``device``. Returns {stage: seconds}, in the order
    the stages first ran; a range the layer does not open is not there.
    """
    time_of = _event_micros(device)
    micros, owner = {}, {}  # stage -> µs over all calls; sequence number of an autograd node -> its stage
    for event in events:
        if event.name.startswith(prefix):
            stage = event.name[len(prefix):]
            nested, nodes = _nested_ranges(event, prefix, time_of)
            micros[stage] = micros.get(stage, 0.0) + time_of(event) - nested
            owner.update(dict.fromkeys(nodes, stage))
    for event in events:
        if event.name.startswith(BACKWARD_EVENT) and event.sequence_nr in owner:
            micros[owner[event.sequence_nr]] += time_of(event)
    return {stage: total / calls / 1e6 for stage, total in micros.items()}


def _nested_ranges(event, prefix: str, time_of) -> tuple[float, set]:
    """(µs of the ranges of ``prefix`` nested in ``event``, the sequence numbers of the ops in its own part)."""
    nested, nodes = 0.0, set()
    for child in event.cpu_children:
        if child.name.startswith(prefix):
            nested += time_of(child)
            continue
        if child.sequence_nr >= 0:
            nodes.add(child.sequence_nr)
        deeper, deeper_nodes = _nested_ranges(child, prefix, time_of)
        nested, nodes = nested + deeper, nodes | deeper_nodes
    return nested, nodes


def op_seconds(events: list, names: tuple[str, ...], calls: int, device: torch.device | str | None = None) -> float:
    """Seconds per call spent in the profiler's ops named ``names`` (e.g. the GEMMs ``aten::mm``), from the events
    of :func:`profile_calls` over ``calls`` calls; an op inside another of ``names`` counts once."""
    time_of = _event_micros(device)
    total = 0.0
    for event in events:
        parent = event.cpu_parent
        while parent is not None and parent.name not in names:
            parent = parent.cpu_parent
        if event.name in names and parent is None:
            total += time_of(event)
    return total / calls / 1e6


def _event_micros(device: torch.device | str | None):
    """How long a profiler event took, in µs, its children included: its kernels' time on a CUDA ``device``, else
    CPU time."""
    return (lambda event: event.device_time_total) if on_cuda(device) else (lambda event: event.cpu_time_total)
