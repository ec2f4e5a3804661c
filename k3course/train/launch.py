"""The command line of a run: ``k3course train`` on one process or ``--ep P`` spawned ranks, and one rank under
torchrun (``python -m k3course.train``); every one of them runs the one loop (:func:`k3course.train.train_run`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from k3course import checkpoint, data, distributed
from k3course.config import K3Config
from k3course.train.config import RunConfig, resolve_config, run_corpus
from k3course.train.loop import Start, StopOnSignal, TrainingInterrupted, find_start, prepare_run, train_run
from k3course.train.step import build_model


def configure(preset_name: str | None = None, out: Path | str | None = None, config_file: Path | str | None = None,
              flags: Sequence[tuple[str, str, object]] = (), sets: Sequence[str] = (), resume: bool = False,
              extend_to: int | None = None) -> tuple[RunConfig, Path, Start | None]:
    """The configuration ``k3course train`` runs (:func:`resolve_config`), its folder (default ``runs/PRESET``)
    and, with ``resume`` or ``extend_to``, the checkpoint it continues from (:func:`find_start`; None for a fresh
    run). With ``resume`` or ``extend_to`` the run's saved configuration is the base unless a preset is named;
    ``extend_to`` N sets ``train.steps`` = N."""
    out = Path(out) if out is not None else Path("runs") / (preset_name or "tiny")
    if resume and extend_to is not None:
        raise ValueError("--extend-to: --resume continues a run as it was and --extend-to gives it more steps; "
                         "use one")
    if extend_to is not None and any(key == "train.steps" for _, key, _ in flags):
        raise ValueError(f"--steps: with --extend-to {extend_to} the run's new total is {extend_to}; leave out --steps")
    start = find_start(out, resume=True) if resume or extend_to is not None else None
    if extend_to is not None:
        flags = [*flags, ("--extend-to", "train.steps", extend_to)]
    config = resolve_config(preset_name, config_file, flags, sets, start.run_config() if start else None)
    return config, out, start


def train_command(preset_name: str | None = None, out: Path | str | None = None, *,
                  config_file: Path | str | None = None, flags: Sequence[tuple[str, str, object]] = (),
                  sets: Sequence[str] = (), resume: bool = False, extend_to: int | None = None, device: str = "cpu",
                  progress: bool = True, notice: Callable[[str], None] | None = None, compile: bool = False,
                  ep: int = 1) -> dict:
    """``k3course train``: the run :func:`configure` describes, in its folder, on one process or (``ep`` P > 1)
    on P local expert-parallel ranks (:func:`train_expert_parallel`); returns a summary dict (out, step,
    val_bpb, seconds, baselines of the run's data, started_at: the step it began from, config).

    ``resume`` continues an interrupted run exactly; ``extend_to`` N trains a run on to step N on a new schedule
    tail (see :func:`k3course.train.run`), and ``notice`` (e.g. print) is told so before training starts.
    ``compile``: train the model compiled (``--compile``, :func:`compile_for_training`; one process only).
    """
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep must be a number of ranks ≥ 1, got {ep!r}")
    if ep > 1 and compile:
        raise ValueError(f"--compile: compiles a one-process run; leave it out with --ep {ep}")
    config, out, start = configure(preset_name, out, config_file, flags, sets, resume, extend_to)
    start = start or find_start(out, resume=False)
    if extend_to is not None and notice is not None:
        notice(f"extending {out} from step {start.step} to {extend_to}: a new schedule tail (from here the learning "
               f"rate follows the warmup + cosine of a {extend_to}-step run); not the same as a straight "
               f"{extend_to}-step run")
    began = time.perf_counter()
    corpus = run_corpus(config.run)
    if ep > 1:
        train_expert_parallel(config, out, start, ep, device=device, extend=extend_to is not None, progress=progress)
    else:
        train_run(config, out, start, corpus=corpus, extend=extend_to is not None, device=device, progress=progress,
                  compile=compile)
    final = checkpoint.read_metrics(out)[-1]
    return {"out": str(out), "step": final["step"], "val_bpb": final.get("val_bpb"), "started_at": start.step,
            "seconds": time.perf_counter() - began, "baselines": data.baselines(corpus), "config": config}


def train_expert_parallel(config: RunConfig, out: Path | str, start: Start, world_size: int, *,
                          device: str = "cpu", extend: bool = False, progress: bool = False,
                          model_factory: Callable[[K3Config, int, object], torch.nn.Module] = build_model) -> None:
    """``k3course train --ep P``: :func:`train_run` on P spawned local ranks (gloo on the CPU; NCCL with rank r on
    GPU r for a CUDA ``device``), from ``start``; ``model_factory`` must be importable by name (spawn).

    The corpus cache is built and the run checked here first (the ranks then only memory-map the bytes). A
    SIGINT / SIGTERM that reaches the ranks (Ctrl-C reaches them all) stops them at one step boundary with a
    checkpoint; this process waits for them and raises their :class:`TrainingInterrupted`.
    """
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    prepare_run(config, start, run_corpus(config.run), extend)
    with StopOnSignal():
        stopped = distributed.run_ranks(train_rank, world_size, config, str(out), start, extend, progress,
                                        model_factory, backend, timeout_s=7 * 24 * 3600, backend=backend)[0]
    if stopped is not None:
        raise TrainingInterrupted(*stopped, Path(out))


def train_rank(rank: int, world_size: int, config: RunConfig, out: str, start: Start, extend: bool, progress: bool,
               model_factory: Callable, backend: str) -> tuple[int, int] | None:
    """One spawned rank of :func:`train_expert_parallel`: :func:`train_run` with expert-parallel experts.
    Returns None, or (signal, step) when a signal stopped the run."""
    try:
        train_run(config, out, start, extend=extend, device=f"cuda:{rank}" if backend == "nccl" else "cpu",
                  progress=progress and rank == 0, model_factory=model_factory, expert_parallel=True)
    except TrainingInterrupted as stopped:
        return stopped.signum, stopped.step
    return None


def main(argv: list[str] | None = None) -> int:
    """``torchrun --standalone --nproc-per-node P -m k3course.train --ep P --preset tiny [--steps N]``: one rank
    of an expert-parallel run (gloo on CPU; NCCL with rank r on GPU r when every rank has a GPU); ``--config``,
    ``--out``, ``--set``, ``--resume`` and ``--extend-to`` as in ``k3course train``."""
    parser = argparse.ArgumentParser(prog="python -m k3course.train", description=main.__doc__)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--config", default=None, metavar="TOML")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--extend-to", type=int, default=None, metavar="N")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (must equal torchrun's P)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run me under torchrun (or use `k3course train --ep P`, which spawns the ranks itself)")
    world_size = int(os.environ["WORLD_SIZE"])
    if args.ep is not None and args.ep != world_size:
        parser.error(f"--ep {args.ep} must equal torchrun's --nproc-per-node ({world_size})")
    device = "cpu"
    if torch.cuda.device_count() >= world_size:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    distributed.join_group("gloo" if device == "cpu" else "nccl")
    rank = dist.get_rank()
    steps = [] if args.steps is None else [("--steps", "train.steps", args.steps)]
    try:
        config, out, start = configure(args.preset, args.out, args.config, steps, args.set, args.resume,
                                       args.extend_to)
        train_run(config, out, start or find_start(out, resume=False), extend=args.extend_to is not None,
                  device=device, progress=rank == 0, expert_parallel=True)
        dist.barrier()  # every rank done before any tears its connections down (as run_ranks does)
    except TrainingInterrupted as stopped:  # every rank stops at the same step (loop.py), so all of them are here
        dist.barrier()
        if rank == 0:
            print(stopped, file=sys.stderr)
        return 128 + stopped.signum
    finally:
        dist.destroy_process_group()
    if rank == 0:
        final = checkpoint.read_metrics(out)[-1]
        print(f"step {final['step']}: loss {final['loss']:.4f}; checkpoints and metrics.jsonl in {out}")
    return 0
