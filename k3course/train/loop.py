"""The door into training, :func:`train`, and the one run loop behind it: a run folder trained from a fresh
start or a checkpoint, on one process or on P ranks.

    out/config.toml     the whole RunConfig (``k3course train --config`` reads it back)
    out/metrics.jsonl   one record per optimizer step (validation bits/byte on the eval schedule and at the end)
    out/step-NNNNNN/    checkpoints on the checkpoint schedule, at the end, and when a signal stops the run
    out/loss.png        the curves and the byte n-gram baselines

Micro-batch j of step s is a function of s (:mod:`k3course.train.step`), so a run resumed from a checkpoint
(weights, optimizer, scheduler, RNG, step) continues exactly as if it had never stopped; ``extend`` trains a
run on to more steps on a new schedule tail. SIGINT / SIGTERM stop it at a step boundary with a checkpoint
(:class:`TrainingInterrupted`).

On P ranks (the default process group: ``k3course train --dp-shard N --ep M``, N·M = P, or torchrun; a rank
calls ``train(config, out, resume, ranks=P, dp_shard=N)``) every rank runs this same loop on the 2-D mesh (N, M)
of :func:`k3course.distributed.parallelize` (every weight sharded, its block of routed experts), with its 1/P of
every micro-batch, and scores its share of the validation windows (:func:`k3course.train.step.evaluate`); rank 0
writes the run's files, and every rank writes its own pieces of each checkpoint (DCP,
:mod:`k3course.distributed.sharded_checkpoint`), which resume on any mesh or on one process. A signal stops every
rank at the same step: each step the ranks agree by an all-reduce (max) of the signal each received, on the
model's device.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from k3course import checkpoint, data, distributed
from k3course.config import K3Config
from k3course.debug import progress_bar
from k3course.distributed import sharded_checkpoint
from k3course.guards import is_number
from k3course.train.config import DTYPES, RunConfig, SavedRun, TrainConfig, read_saved_run, run_corpus
from k3course.train.step import (
    LN2,
    Stepper,
    build_model,
    compile_for_training,
    evaluate,
    make_optimizer,
    make_scheduler,
    text_batches,
)


class TrainingInterrupted(Exception):
    """A run stopped by SIGINT or SIGTERM at a step boundary, after writing the checkpoint of that step."""

    def __init__(self, signum: int, step: int, out: Path):
        self.signum, self.step, self.out = signum, step, out
        super().__init__(f"train: {signal.Signals(signum).name} at step {step}: checkpoint "
                         f"{checkpoint.step_dir(out, step)} written; resume exactly with: "
                         f"k3course train --out {shlex.quote(str(out))} --resume")


class StopOnSignal:
    """While entered (in the main thread): SIGINT / SIGTERM are noted in ``received`` and the work in progress
    goes on; the previous handlers come back at once, so a second signal acts as it did before."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.received = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.getsignal(signum) for signum in self.SIGNALS}
            for signum in self.SIGNALS:
                signal.signal(signum, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.received = signum
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def __exit__(self, *exc) -> None:
        self._restore()


# --- where a run starts ---------------------------------------------------------------------------------

def _find_start(out: Path, resume: bool | str) -> SavedRun | None:
    """Validate the run folder ``out``: with ``resume`` its latest checkpoint, read once
    (:func:`read_saved_run`); else None, a fresh start (``out`` must then hold no checkpoint)."""
    if not (isinstance(resume, bool) or resume == "extend"):
        raise ValueError(f"resume must be False, True or \"extend\", got {resume!r}")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out: {out} is a file, not a folder for checkpoints")
    latest = checkpoint.latest_checkpoint(out)
    if resume and latest is None:
        raise FileNotFoundError(f"out: no checkpoint to resume in {out}")
    if not resume and latest is not None:
        raise FileExistsError(f"out: {out} already holds checkpoints ({latest.name}); resume or use another out")
    return read_saved_run(latest) if resume else None


def _differences(saved: RunConfig, config: RunConfig) -> list[str]:
    """``section.field=saved value`` for every field in which ``config`` differs from ``saved``."""
    return [f"{section}.{f.name}={getattr(old, f.name)!r}" for section, old in saved.sections().items()
            for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(config.sections()[section], f.name)]


def _check_resume(saved: SavedRun, config: RunConfig, extend: bool) -> None:
    """A run continues only with its own settings (``extend``: all but ``train.steps``); errors name them."""
    differ = [d for d in _differences(saved.config, config) if not (extend and d.startswith("train.steps="))]
    if differ:
        hint = "; to train a run further than its steps, use --extend-to N" if any(
            d.startswith("train.steps=") for d in differ) else ""
        raise ValueError(f"train: resuming needs the run's own settings; these differ from {saved.folder}: "
                         f"{', '.join(differ)}{hint}")


def _check_corpus(corpus: data.ByteCorpus, model_config: K3Config, train: TrainConfig) -> None:
    """Bytes need a vocabulary of 256, and each split at least one window of seq_len + 1 bytes (+ 1 to draw)."""
    if model_config.vocab_size < 256:
        raise ValueError(f"model.vocab_size must be ≥ 256 to train on bytes, got {model_config.vocab_size}")
    for split, need in (("train", train.seq_len + 2), ("val", train.seq_len + 1)):
        if len(corpus.split(split)) < need:
            raise ValueError(f"data: the {split} split holds {len(corpus.split(split))} bytes; train.seq_len = "
                             f"{train.seq_len} needs at least {need}")


def _check_same_corpus(saved: SavedRun, corpus: data.ByteCorpus) -> None:
    """A resumed run reads the bytes it began with (the corpus key hashes the files' list, sizes and times)."""
    before = saved.corpus_key or corpus.meta["key"]
    if before != corpus.meta["key"]:
        raise ValueError(f"data: the files changed since {saved.folder} was written (corpus {before} is now "
                         f"{corpus.meta['key']}): resuming would not be exact; --extend-to N trains on the new bytes")


def _extensions(saved: SavedRun | None, train: TrainConfig, extend: bool) -> list[dict]:
    """The run's extensions so far, plus this one when ``extend``: ``{"at_step", "steps_before", "steps_after"}``."""
    if saved is None:
        return []
    if not extend:
        return list(saved.extensions)
    if train.steps <= saved.step:
        raise ValueError(f"extend_to: must be more than the run's step {saved.step}, got {train.steps}")
    this = {"at_step": saved.step, "steps_before": saved.config.train.steps, "steps_after": train.steps}
    return [*saved.extensions, this]


def _prepare(config: RunConfig, saved: SavedRun | None, corpus: data.ByteCorpus, extend: bool) -> dict:
    """Check that ``config`` can train on ``corpus`` from ``saved`` (a resume: the saved settings and bytes;
    ``extend``: all settings but ``train.steps``, which must grow); returns what every checkpoint's config.json
    holds but the step: the RunConfig's tables, the corpus key and splits, the extensions."""
    if saved is not None:
        _check_resume(saved, config, extend)
    _check_corpus(corpus, config.model, config.train)
    if saved is not None and not extend:
        _check_same_corpus(saved, corpus)
    return {**config.as_dict(), "corpus": {"key": corpus.meta["key"], "splits": corpus.meta["splits"]},
            "extensions": _extensions(saved, config.train, extend)}


# --- the door ----------------------------------------------------------------------------------------------

def train(config: RunConfig, out: Path | str, resume: bool | str = False, *, ranks: int = 1, dp_shard: int = 1,
          corpus: data.ByteCorpus | None = None, device: torch.device | str = "cpu", progress: bool = True,
          model_factory: Callable[[K3Config, int, object], torch.nn.Module] | None = None,
          compile: bool = False) -> torch.nn.Module | None:
    """Train the run ``config`` in the folder ``out`` to ``config.train.steps``: metrics every step, evaluations
    and checkpoints on their schedule and at the end (see the module docstring); on SIGINT / SIGTERM a checkpoint
    at the next step boundary, then :class:`TrainingInterrupted`. Returns the model trained in this process
    (None in the process that spawned ranks). The one way every run starts: ``k3course train`` (``--ep P``
    too), ``python -m k3course.train`` under torchrun, the lessons and the tests.

    ``resume``: False, a fresh run (``out`` must hold no checkpoint); True, continue the latest checkpoint in
    ``out`` exactly, as if it had never stopped (``config`` and the corpus must be the saved ones); "extend",
    continue it to a new total ``config.train.steps`` (all other settings the saved ones) on a new schedule
    tail: from the checkpoint's step the learning rate follows the warmup + cosine of a ``train.steps``-step
    run, which is NOT a straight run of that many steps (its first steps followed the old, shorter cosine).

    ``ranks``: P ranks. P = 1 trains in this process. P > 1 in a process that is already one of P ranks of the
    default process group (torchrun: ``python -m k3course.train``) trains as that rank: every rank calls
    ``train`` together, with its shards and its 1/P of every micro-batch, and rank 0 writes the run's files.
    P > 1 anywhere else spawns P local ranks (gloo on the CPU; NCCL with rank r on GPU r for a CUDA ``device``)
    after checking the run here once; ``model_factory`` must then be importable by name.

    ``dp_shard``: the P ranks form a 2-D mesh of dp_shard × (P / dp_shard) ranks ("dp_shard", "ep";
    :func:`k3course.distributed.parallelize`): FSDP2 over all P for every weight but the routed experts, expert
    parallelism over "ep" (which must divide the routed experts), the experts FSDP-sharded over "dp_shard";
    dp_shard = 1 is expert parallelism with every other weight sharded, not copied. Such a run writes sharded
    checkpoints (DCP: each rank its own pieces, nothing gathered;
    :mod:`k3course.distributed.sharded_checkpoint`), which resume on any number of ranks and any mesh, one
    process included (which then writes them too). A one-process checkpoint resumes on P ranks too: rank 0
    rewrites it as a sharded one first, which every rank then reads its shards from.

    ``corpus``: the bytes (default: ``config.run``'s, :func:`run_corpus`; not with spawned ranks, which read
    ``config.run``'s). ``model_factory(model_config, seed, device)`` builds the fresh model (default:
:func:`build_model` with the kernel backend ``config.run.kernels``). ``compile``: train
    the model compiled (:func:`compile_for_training`; one process only; the same steps to fp32 rounding, so a
    run may be resumed with or without it).
    """
    if not is_number(ranks) or ranks < 1:
        raise ValueError(f"ranks must be a number of expert-parallel ranks ≥ 1, got {ranks!r}")
    if ranks > 1 and compile:
        raise ValueError(f"compile: compiles a one-process run; leave it out with {ranks} ranks")
    if not is_number(dp_shard) or dp_shard < 1 or ranks % dp_shard:
        raise ValueError(f"dp_shard must be a positive int dividing the {ranks} ranks, got {dp_shard!r}")
    if config.train.batch_size % ranks:
        raise ValueError(f"train.batch_size {config.train.batch_size} must be a multiple of the {ranks} ranks "
                         "(each reads its share of every micro-batch)")
    if config.model.n_routed_experts % (ranks // dp_shard):
        raise ValueError(f"ep: {ranks // dp_shard} expert-parallel ranks must divide the model's "
                         f"{config.model.n_routed_experts} routed experts (equal blocks, as a sharded checkpoint "
                         "stores them)")
    model_factory = model_factory or functools.partial(build_model, kernels=config.run.kernels)
    out = Path(out)
    saved = _find_start(out, resume)
    mesh = _mesh(saved, ranks, dp_shard)
    if ranks > 1 and not (dist.is_initialized() and dist.get_world_size() == ranks):
        if corpus is not None:
            raise ValueError("corpus: spawned ranks read config.run's data; leave corpus out with ranks > 1")
        _spawn_ranks(config, out, saved, resume == "extend", ranks, mesh, device, progress, model_factory)
        return None
    corpus = corpus or run_corpus(config.run)
    run_record = _prepare(config, saved, corpus, resume == "extend")
    return _train_here(config, out, saved, run_record, corpus, resume == "extend", device, progress, model_factory,
                       compile, expert_parallel=ranks > 1, mesh=mesh)


def _mesh(saved: SavedRun | None, ranks: int, dp_shard: int) -> tuple[int, int] | None:
    """The run's 2-D mesh (dp_shard, P / dp_shard), or None: one process writing one-process checkpoints. A run
    that writes sharded checkpoints keeps writing them: on one process, with the plain model (mesh (1, 1))."""
    if ranks == 1 and not (saved is not None and sharded_checkpoint.is_sharded_checkpoint(saved.folder)):
        return None
    return dp_shard, ranks // dp_shard


def _spawn_ranks(config: RunConfig, out: Path, saved: SavedRun | None, extend: bool, ranks: int, mesh, device,
                 progress: bool, model_factory: Callable) -> None:
    """:func:`train` on ``ranks`` spawned local ranks, the run checked and the corpus cache built here once (the
    ranks then only memory-map the bytes). A SIGINT / SIGTERM that reaches the ranks (Ctrl-C reaches them all)
    stops them at one step boundary with a checkpoint; this process waits for them and raises their
    :class:`TrainingInterrupted`."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    run_record = _prepare(config, saved, run_corpus(config.run), extend)
    with StopOnSignal():
        stopped = distributed.run_ranks(_spawned_rank, ranks, config, str(out), saved, run_record, extend, mesh,
                                        progress, model_factory, timeout_s=7 * 24 * 3600, backend=backend)[0]
    if stopped is not None:
        raise TrainingInterrupted(*stopped, out)


def _spawned_rank(rank: int, world_size: int, config: RunConfig, out: str, saved: SavedRun | None, run_record: dict,
                  extend: bool, mesh, progress: bool, model_factory: Callable) -> tuple[int, int] | None:
    """One rank of :func:`_spawn_ranks` (the group joined): the run, checked by the parent, trained as this rank.
    Returns None, or (signal, step) when a signal stopped the run."""
    device = f"cuda:{rank}" if dist.get_backend() == "nccl" else "cpu"
    try:
        _train_here(config, Path(out), saved, run_record, run_corpus(config.run), extend, device,
                    progress and rank == 0, model_factory, compile=False, expert_parallel=True, mesh=mesh)
    except TrainingInterrupted as stopped:
        return stopped.signum, stopped.step
    return None


def _train_here(config: RunConfig, out: Path, saved: SavedRun | None, run_record: dict, corpus: data.ByteCorpus,
                extend: bool, device, progress: bool, model_factory: Callable, compile: bool,
                expert_parallel: bool, mesh: tuple[int, int] | None = None) -> torch.nn.Module:
    """The run trained in this process (one process, or one rank of the default group): see :func:`train`."""
    stepper = _stepper(config, saved, corpus, extend, device, model_factory, expert_parallel, mesh)
    if compile:
        compile_for_training(stepper.model, config.train)
    writes = not expert_parallel or dist.get_rank() == 0
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(config.toml())
    _train_loop(stepper, corpus, config, out, run_record, progress and writes, sharded=mesh is not None)
    if writes:
        _plot_losses(out, data.baselines(corpus))
    return stepper.model


def _stepper(config: RunConfig, saved: SavedRun | None, corpus: data.ByteCorpus, extend: bool, device,
             model_factory: Callable, expert_parallel: bool, mesh: tuple[int, int] | None) -> Stepper:
    """The run's :class:`Stepper` at ``saved``'s step: on one process without a mesh, the checkpoint's weights,
    optimizer, schedule and RNG; on a mesh, the checkpoint read into the sharded model and optimizer, each rank
    its pieces (:func:`_load_sharded`). ``extend``: the schedule of the new total from the checkpoint's step."""
    sharded = saved is not None and mesh is not None

    def restored(model_config: K3Config, seed: int, device) -> torch.nn.Module:
        model = model_factory(model_config, seed, device)
        if saved is not None and not sharded:
            checkpoint.load_weights(saved.folder, model)
        return model

    stepper = Stepper(config.model, config.train, text_batches(corpus.train, config.train, device), device,
                      autocast=DTYPES[config.run.dtype], expert_parallel=expert_parallel,
                      mesh=mesh if expert_parallel else None, model_factory=restored)
    if sharded:
        _load_sharded(stepper, saved, functools.partial(_resharded, saved, config, model_factory, device))
    elif saved is not None:
        checkpoint.load_state(saved.folder, stepper.optimizer, stepper.scheduler)
        stepper.steps_taken = saved.step
    if extend:
        stepper.scheduler = make_scheduler(stepper.optimizer, config.train, stepper.steps_taken)
    return stepper


def _sharded_extra(scheduler) -> dict:
    """What a sharded checkpoint holds besides weights and moments: the schedule and the torch RNG."""
    return {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}


RESHARDING = ".resharding"  # in a run folder: a one-process checkpoint rewritten as a sharded one, while read


def _load_sharded(stepper: Stepper, saved: SavedRun, resharded: Callable[[], Path]) -> None:
    """``saved`` into ``stepper`` on its mesh: each rank reads the pieces of its shards; the schedule, RNG and
    step. A one-process checkpoint is first rewritten as a sharded one by rank 0 (``resharded()``, the same
    weights, moments, schedule and RNG), removed once every rank has read it."""
    folder = saved.folder
    one_process = not sharded_checkpoint.is_sharded_checkpoint(folder)
    if one_process:
        folder = resharded() if dist.get_rank() == 0 else sharded_checkpoint.step_folder(
            folder.parent / RESHARDING, saved.step)
        dist.barrier()
    extra = sharded_checkpoint.load_sharded(folder, stepper.model, stepper.optimizer, stepper.mesh,
                                            _sharded_extra(stepper.scheduler))
    if one_process:
        dist.barrier()  # every rank has read its pieces
        if dist.get_rank() == 0:
            shutil.rmtree(folder.parent)
    stepper.scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    stepper.steps_taken = saved.step


def _resharded(saved: SavedRun, config: RunConfig, model_factory: Callable, device) -> Path:
    """The one-process checkpoint ``saved`` written as a sharded checkpoint (weights, AdamW's moments, schedule,
    RNG) into out/.resharding/, by this process alone, through the one-process model and optimizer it builds for
    it (the RNG left as it was); any mesh reads its shards from it. Returns its folder."""
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        model = model_factory(config.model, config.train.seed, device)
        checkpoint.load_weights(saved.folder, model)
        optimizer, scheduler = make_optimizer(model, config.train)
        checkpoint.load_state(saved.folder, optimizer, scheduler)
        extra = _sharded_extra(scheduler)
    return sharded_checkpoint.save_sharded(saved.folder.parent / RESHARDING, saved.step, model, optimizer, None,
                                           extra)


def _due(step: int, every: int, last: int) -> bool:
    """Whether an evaluation / checkpoint on an ``every``-step schedule (0: only at the end) falls on ``step``."""
    return step == last or bool(every and step % every == 0)


def _train_loop(stepper: Stepper, corpus: data.ByteCorpus, config: RunConfig, out: Path, run_record: dict,
                progress: bool, sharded: bool = False) -> None:
    """Steps ``stepper.steps_taken`` → ``train.steps`` (see :func:`train`); on P ranks rank 0 writes."""
    train, writes = config.train, not stepper.expert_parallel or dist.get_rank() == 0
    metrics = checkpoint.MetricsLog(out, keep_until=stepper.steps_taken) if writes else None
    windows = data.eval_windows(corpus.val, train.seq_len, train.eval_bytes)
    bar = progress_bar(total=train.steps, initial=stepper.steps_taken, disable=not progress, desc="train",
                       unit="step")
    with StopOnSignal() as stop:
        while stepper.steps_taken < train.steps:
            began = time.perf_counter()
            record = stepper()
            step = stepper.steps_taken
            record = {"step": step, **record, "tokens_per_s": train.tokens_per_step / (time.perf_counter() - began)}
            if _due(step, train.eval_every, train.steps):
                record["val_loss"] = evaluate(stepper.model, windows, train.batch_size, stepper.autocast)
                record["val_bpb"] = record["val_loss"] / LN2
            if metrics is not None:
                metrics.write(record)
            _show(bar, record)
            stopped_by = _agreed_signal(stop.received, stepper)
            if _due(step, train.checkpoint_every, train.steps) or stopped_by:
                _checkpoint(stepper, out, run_record, sharded)
            if stopped_by and step < train.steps:
                bar.close()
                raise TrainingInterrupted(stopped_by, step, out)
    bar.close()


def _show(bar, record: dict) -> None:
    """Advance the progress bar by one step, showing the step's numbers."""
    bar.update(1)
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                    max_viol=f"{record['max_violation']:.2f}",
                    **({"val_bpb": f"{record['val_bpb']:.3f}"} if "val_bpb" in record else {}))


def _agreed_signal(received: int | None, stepper: Stepper) -> int:
    """The signal that stops the run after this step (0: none): this process's, or on P ranks the largest
    any rank received (an all-reduce on the model's device), so every rank stops at the same step."""
    if not stepper.expert_parallel:
        return received or 0
    flag = torch.tensor(received or 0, device=next(stepper.model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag)


def _checkpoint(stepper: Stepper, out: Path, run_record: dict, sharded: bool) -> Path:
    """The checkpoint of ``stepper``'s step in ``out``: ``sharded``, each rank (or the one process) writes its
    pieces (:func:`sharded_checkpoint.save_sharded`); else the one-process checkpoint
    (:func:`checkpoint.save_checkpoint`). Returns the folder."""
    step = stepper.steps_taken
    if sharded:
        return sharded_checkpoint.save_sharded(out, step, stepper.model, stepper.optimizer, stepper.mesh,
                                               _sharded_extra(stepper.scheduler), run_record)
    return checkpoint.save_checkpoint(out, step, stepper.model, stepper.optimizer, stepper.scheduler, run_record)


def _plot_losses(out: Path, baselines: dict[str, float] | None = None) -> Path:
    """loss.png in ``out``: training and validation bits/byte against step, n-gram baselines as lines, each in a
    colour of its own; the y axis holds the first step's loss, the legend sits beside the axes, not on the curves."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = checkpoint.read_metrics(out)
    figure = Figure(figsize=(8.5, 4), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    steps = [r["step"] for r in records if "loss" in r]
    train_bits = [r["loss"] / LN2 for r in records if "loss" in r]
    axes.plot(steps, train_bits, lw=0.8, color="C0", label="train (incl. aux)")
    evals = [r for r in records if "val_bpb" in r]
    axes.plot([r["step"] for r in evals], [r["val_bpb"] for r in evals], "o-", color="C1", label="validation")
    for index, (name, value) in enumerate((baselines or {}).items()):
        axes.axhline(value, color=f"C{2 + index}", ls=(":", "--", "-.", (0, (5, 2, 1, 2)))[index % 4], lw=1.2,
                     label=name)
    axes.set(xlabel="optimizer step", ylabel="bits per byte", ylim=(0, 1.05 * max([8.0, *train_bits])))
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    path = Path(out) / "loss.png"
    figure.savefig(path, dpi=100)
    return path
