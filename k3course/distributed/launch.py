"""Run a function on P local processes joined by torch.distributed (gloo on CPU), and collect what each returns.

The processes are spawned (each imports the package afresh) or, with ``start_method="fork"``, forked (each a copy
of the caller, so ``fn`` may be any function, a notebook's included; CPU and gloo only), rendezvous through a file
in a fresh temporary folder (no port to collide with parallel runs) and return their results through files. A rank
that raises ends the run at once with its traceback; a rank that hangs makes the others' collectives fail after
``collective_timeout_s``, and the whole run is stopped after ``timeout_s``: never a silent hang.
"""

from __future__ import annotations

import datetime
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank of :func:`run_ranks` raised; the message holds the traceback of the rank that failed first."""


def _worker(rank: int, fn, world_size: int, folder: str, args: tuple, collective_timeout_s: float,
            backend: str) -> None:
    """One spawned rank: join the group, run fn(rank, world_size, *args), save its result (or the time and
    traceback of its error), wait for every rank to be done (a rank that leaves early would take the group's
    rendezvous away from one still joining), leave the group."""
    torch.set_num_threads(1)  # P processes share the cores: one thread each avoids OpenMP oversubscription
    if backend == "nccl":
        torch.cuda.set_device(rank)  # rank r drives GPU r
    try:
        dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=collective_timeout_s))
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"result_{rank}.pt")
        dist.barrier()
    except BaseException:
        (Path(folder) / f"error_{rank}.txt").write_text(f"{time.time()}\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, collective_timeout_s: float = 60.0,
              backend: str = "gloo", start_method: str = "spawn") -> list:
    """[fn(0, P, *args), …, fn(P−1, P, *args)], each run in its own process of a P-rank process group.

    backend 'gloo' (CPU processes) or 'nccl' (rank r on GPU r; needs P GPUs).
    start_method 'spawn': fn must be importable by name (a function of a module in the package, not of a test
    file or __main__); 'fork' (POSIX, gloo): each rank is a copy of this process, so fn and args need no pickling.
    Raises :class:`RankFailed` with the traceback of the first rank that raised (the others then fail too: their
    peer is gone), and TimeoutError naming the ranks still running after timeout_s seconds.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
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
