"""Run a function on P local processes joined by torch.distributed (gloo on CPU), and collect what each returns.

The processes are spawned (each imports the package afresh) or, with ``start_method="fork"``, forked (each a copy
of the caller, so ``fn`` may be any function, a notebook's included; CPU and gloo only), rendezvous through a file
in a fresh temporary folder (no port to collide with parallel runs) and return their results through files. A rank
that raises ends the run at once with its traceback; a rank that hangs makes the others' collectives fail after
``collective_timeout_s``, and the whole run is stopped after ``timeout_s``: never a silent hang. A rank that dies
in native code (a signal, an abort) is reported with the stacks ``faulthandler`` wrote for it.

A rank joins its group with :func:`join_group` and leaves it with :func:`leave_group`. Leaving must end the
group's threads (gloo runs a network loop and two worker threads per group) while the interpreter is whole: a
group whose last reference outlives ``destroy_process_group`` is torn down during interpreter shutdown, its
threads still running, and the rank may die there with "terminate called without an active exception"
(SIGABRT). torch itself keeps such references: ``torch.distributed.nn.functional`` binds the default group as
the default argument of ten functions when it is imported, and it is imported lazily (by ``torch._dynamo``,
which the first optimizer imports). So :func:`join_group` imports it before the group exists.
"""

from __future__ import annotations

import datetime
import faulthandler
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3course.guards import is_number


class RankFailed(RuntimeError):
    """A rank of :func:`run_ranks` raised; the message holds the traceback of the rank that failed first."""


def join_group(backend: str, **options) -> None:
    """``dist.init_process_group(backend, **options)``, after importing every torch module that binds the default
    group at import time (see the module docstring), so that :func:`leave_group` ends the group's threads."""
    import torch.distributed.nn.functional  # noqa: F401  (binds group.WORLD, still None here, as defaults)

    dist.init_process_group(backend, **options)


def leave_group() -> None:
    """Wait for every rank of the default group (one that left early would take the group away from one still
    in a collective), then destroy the group: its threads end here, not at interpreter shutdown."""
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank: int, fn, world_size: int, folder: str, args: tuple, collective_timeout_s: float,
            backend: str) -> None:
    """One spawned rank: join the group, run fn(rank, world_size, *args), save its result (or the time and
    traceback of its error), leave the group (:func:`leave_group`; a failed rank just destroys it). A native
    crash writes every thread's Python stack to fault_{rank}.txt (faulthandler)."""
    fault_file = open(Path(folder) / f"fault_{rank}.txt", "w")  # noqa: SIM115  (open until the process ends)
    faulthandler.enable(file=fault_file)
    torch.set_num_threads(1)  # P processes share the cores: one thread each avoids OpenMP oversubscription
    if backend == "nccl":
        torch.cuda.set_device(rank)  # rank r drives GPU r
    try:
        join_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size,
                   timeout=datetime.timedelta(seconds=collective_timeout_s))
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"result_{rank}.pt")
        leave_group()
    except BaseException:
        (Path(folder) / f"error_{rank}.txt").write_text(f"{time.time()}\n{traceback.format_exc()}")
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, collective_timeout_s: float = 60.0,
              backend: str = "gloo", start_method: str = "spawn") -> list:
    """[fn(0, P, *args), …, fn(P−1, P, *args)], each run in its own process of a P-rank process group.

    backend 'gloo' (CPU processes) or 'nccl' (rank r on GPU r; needs P GPUs).
    start_method 'spawn': fn must be importable by name (a function of a module in the package, not of a test
    file or __main__); 'fork' (POSIX, gloo): each rank is a copy of this process, so fn and args need no pickling.
    Raises :class:`RankFailed` with the traceback of the first rank that raised (the others then fail too: their
    peer is gone), and TimeoutError naming the ranks still running after timeout_s seconds.
    """
    if not is_number(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if start_method not in ("spawn", "fork"):
        raise ValueError(f"start_method must be 'spawn' or 'fork', got {start_method!r}")
    if start_method == "fork" and backend != "gloo":
        raise ValueError("start_method 'fork' needs backend 'gloo' (a forked child cannot use CUDA)")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend 'nccl' needs world_size = {world_size} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="k3course_ep_") as folder:
        context = mp.start_processes(_worker, args=(fn, world_size, folder, args, collective_timeout_s, backend),
                                     nprocs=world_size, join=False, start_method=start_method)
        try:
            _join(context, world_size, timeout_s)
        except mp.ProcessRaisedException as error:
            raise RankFailed(_first_error(Path(folder), world_size)) from error
        except mp.ProcessExitedException as error:
            raise RankFailed(_native_death(Path(folder), error)) from error
        return [torch.load(Path(folder) / f"result_{rank}.pt", weights_only=False) for rank in range(world_size)]


def _join(context, world_size: int, timeout_s: float) -> None:
    """Wait for every rank; stop them all and raise TimeoutError after timeout_s seconds."""
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            running = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
            for process in context.processes:
                process.terminate()
            raise TimeoutError(f"ranks {running} of {world_size} still running after timeout_s = {timeout_s} s")


def _native_death(folder: Path, error: mp.ProcessExitedException) -> str:
    """'rank r died of SIGNAL (or exit code c)' with the Python stacks of its threads that faulthandler wrote,
    or, when the rank raised before it reached its worker (spawn's import of fn), that it wrote none."""
    cause = f"died of {error.signal_name}" if error.signal_name else f"exited with code {error.exit_code}"
    fault = folder / f"fault_{error.error_index}.txt"
    stacks = fault.read_text() if fault.exists() else ""
    return (f"rank {error.error_index} {cause} without a Python exception; its threads' stacks:\n{stacks}"
            if stacks.strip() else f"rank {error.error_index} {cause} without a Python exception (its output "
                                   "above says why: e.g. spawn could not import fn)")


def _first_error(folder: Path, world_size: int) -> str:
    """'rank r failed first (f of P failed):' and rank r's traceback, from the error files the ranks wrote."""
    errors = []
    for rank in range(world_size):
        path = folder / f"error_{rank}.txt"
        if path.exists():
            when, text = path.read_text().split("\n", 1)
            errors.append((float(when), rank, text))
    if not errors:
        return "a rank died without a Python traceback (killed, or crashed in native code)"
    when, rank, text = min(errors)
    return f"rank {rank} failed first ({len(errors)} of {world_size} ranks failed):\n{text}"
