"""The one run loop: a run folder trained from a fresh start or a checkpoint, on one process or on P ranks.

    out/config.toml     the whole RunConfig (``k3course train --config`` reads it back)
    out/metrics.jsonl   one record per optimizer step (validation bits/byte on the eval schedule and at the end)
    out/step-NNNNNN/    checkpoints on the checkpoint schedule, at the end, and when a signal stops the run
    out/loss.png        the curves and the byte n-gram baselines

Micro-batch j of step s is a function of s (:mod:`k3course.train.step`), so a run resumed from a checkpoint
(weights, optimizer, scheduler, RNG, step) continues exactly as if it had never stopped; ``extend`` trains a
run on to more steps on a new schedule tail. SIGINT / SIGTERM stop it at a step boundary with a checkpoint
(:class:`TrainingInterrupted`).

On P expert-parallel ranks (the default process group: ``k3course train --ep P`` or torchrun) every rank runs
this same loop with its block of routed experts and its 1/P of every micro-batch, and scores its share of the
validation windows (:func:`k3course.train.evaluate`); rank 0 does all the writing. A checkpoint is always a
one-process checkpoint: the experts' blocks and their optimizer moments are gathered from all ranks, and a
resume on P ranks cuts them again, so a run may be continued on any number of ranks. A signal stops every rank
at the same step: each step the ranks agree by an all-reduce (max) of the signal each received, on the model's
device.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from k3course import checkpoint, data, distributed
from k3course.config import K3Config
from k3course.debug import progress_bar
from k3course.train.config import DTYPES, RunConfig, RunOptions, TrainConfig, run_config_of, run_corpus
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

@dataclass(frozen=True)
class Start:
    """Where a run begins: ``folder`` None for a fresh run, else the checkpoint it continues from and ``saved``,
    that checkpoint's config.json (:func:`checkpoint.read_config`), read once."""

    folder: Path | None = None
    saved: dict = field(default_factory=dict)

    @property
    def step(self) -> int:
        """The optimizer steps already taken (0 for a fresh run)."""
        return self.saved.get("step", 0)

    def run_config(self) -> RunConfig:
        """The RunConfig the checkpoint was trained with."""
        return run_config_of(self.saved, self.folder)


def find_start(out: Path | str, resume: bool) -> Start:
    """Validate the run folder ``out``; with ``resume`` its latest checkpoint (looked up once, its config read
    once), else a fresh start (``out`` must then hold no checkpoint)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out: {out} is a file, not a folder for checkpoints")
    latest = checkpoint.latest_checkpoint(out)
    if resume and latest is None:
        raise FileNotFoundError(f"out: no checkpoint to resume in {out}")
    if not resume and latest is not None:
        raise FileExistsError(f"out: {out} already holds checkpoints ({latest.name}); resume or use another out")
    return Start(latest, checkpoint.read_config(latest)) if resume else Start()


def _differences(saved: RunConfig, config: RunConfig) -> list[str]:
    """``section.field=saved value`` for every field in which ``config`` differs from ``saved``."""
    return [f"{section}.{f.name}={getattr(old, f.name)!r}" for section, old in saved.sections().items()
            for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(config.sections()[section], f.name)]


def _check_resume(start: Start, config: RunConfig, extend: bool) -> None:
    """A run continues only with its own settings (``extend``: all but ``train.steps``); errors name them."""
    differ = [d for d in _differences(start.run_config(), config) if not (extend and d.startswith("train.steps="))]
    if differ:
        hint = "; to train a run further than its steps, use --extend-to N" if any(
            d.startswith("train.steps=") for d in differ) else ""
        raise ValueError(f"train: resuming needs the run's own settings; these differ from {start.folder}: "
                         f"{', '.join(differ)}{hint}")


def _check_corpus(corpus: data.ByteCorpus, model_config: K3Config, train: TrainConfig) -> None:
    """Bytes need a vocabulary of 256, and each split at least one window of seq_len + 1 bytes (+ 1 to draw)."""
    if model_config.vocab_size < 256:
        raise ValueError(f"model.vocab_size must be ≥ 256 to train on bytes, got {model_config.vocab_size}")
    for split, need in (("train", train.seq_len + 2), ("val", train.seq_len + 1)):
        if len(corpus.split(split)) < need:
            raise ValueError(f"data: the {split} split holds {len(corpus.split(split))} bytes; train.seq_len = "
                             f"{train.seq_len} needs at least {need}")


def _check_same_corpus(start: Start, corpus: data.ByteCorpus) -> None:
    """A resumed run reads the bytes it began with (the corpus key hashes the files' list, sizes and times)."""
    before = start.saved.get("corpus", {}).get("key", corpus.meta["key"])
    if before != corpus.meta["key"]:
        raise ValueError(f"data: the files changed since {start.folder} was written (corpus {before} is now "
                         f"{corpus.meta['key']}): resuming would not be exact; --extend-to N trains on the new bytes")


def _extensions(start: Start, train: TrainConfig, extend: bool) -> list[dict]:
    """The run's extensions so far, plus this one when ``extend``: ``{"at_step", "steps_before", "steps_after"}``."""
    if not extend:
        return start.saved.get("extensions", [])
    if train.steps <= start.step:
        raise ValueError(f"extend_to: must be more than the run's step {start.step}, got {train.steps}")
    this = {"at_step": start.step, "steps_before": start.saved["train"]["steps"], "steps_after": train.steps}
    return [*start.saved.get("extensions", []), this]


def prepare_run(config: RunConfig, start: Start, corpus: data.ByteCorpus, extend: bool = False) -> dict:
    """Check that ``config`` can train on ``corpus`` from ``start`` (a resume: the saved settings and bytes;
    ``extend``: all settings but ``train.steps``, which must grow); returns what every checkpoint's config.json
    holds: the RunConfig's tables, the corpus key and splits, the extensions."""
    if start.folder is not None:
        _check_resume(start, config, extend)
    _check_corpus(corpus, config.model, config.train)
    if start.folder is not None and not extend:
        _check_same_corpus(start, corpus)
    extensions = _extensions(start, config.train, extend)
    return {**config.as_dict(), "corpus": {"key": corpus.meta["key"], "splits": corpus.meta["splits"]},
            "extensions": extensions}


# --- the run ---------------------------------------------------------------------------------------------

def run(model_config: K3Config, train: TrainConfig, out: Path | str, resume: bool = False,
        corpus: data.ByteCorpus | None = None, device: torch.device | str = "cpu", progress: bool = True,
        model_factory: Callable[[K3Config, int, object], torch.nn.Module] = build_model,
        options: RunOptions | None = None, extend: bool = False, compile: bool = False) -> torch.nn.Module:
    """Train (or resume) a run in ``out`` on one process: :func:`train_run` of ``RunConfig(model_config, train,
    options)`` from :func:`find_start`. Returns the model.

    ``resume=True`` continues from the latest checkpoint in ``out`` up to ``train.steps``, exactly as if it had
    never stopped (the settings and the corpus must be the saved ones). ``extend=True`` continues it to a new
    total ``train.steps`` (all other settings the saved ones) on a new schedule tail: from the current step the
    learning rate follows the warmup + cosine of a ``train.steps``-step run, which is NOT a straight run of that
    many steps (its first steps followed the old, shorter cosine). ``resume=extend=False`` refuses an ``out``
    that already holds checkpoints. ``options``: the data and the precision (:class:`RunOptions`); ``corpus``
    overrides the data (default: the stdlib in float32). ``model_factory(model_config, seed, device)`` builds
    the fresh model.
    """
    config = RunConfig(model_config, train, options or RunOptions())
    return train_run(config, out, find_start(out, resume or extend), corpus=corpus, extend=extend, device=device,
                     progress=progress, model_factory=model_factory, compile=compile)


def train_run(config: RunConfig, out: Path | str, start: Start, *, corpus: data.ByteCorpus | None = None,
              extend: bool = False, device: torch.device | str = "cpu", progress: bool = True,
              model_factory: Callable[[K3Config, int, object], torch.nn.Module] = build_model,
              compile: bool = False, expert_parallel: bool = False) -> torch.nn.Module:
    """Train the run ``config`` in ``out`` from ``start`` (:func:`find_start`) to ``config.train.steps``: metrics
    every step, evaluations and checkpoints on their schedule and at the end; on SIGINT / SIGTERM a checkpoint
    at the next step boundary, then :class:`TrainingInterrupted`. Returns the model.

    ``expert_parallel``: this process is one rank of the default process group, and every rank calls this
    together (see the module docstring); rank 0 writes. ``compile``: train the model compiled
    (:func:`compile_for_training`; the same steps to fp32 rounding, so a run may be resumed with or without it).
    """
    out, corpus = Path(out), corpus or run_corpus(config.run)
    whole = prepare_run(config, start, corpus, extend)
    stepper = _stepper(config, start, corpus, extend, device, model_factory, expert_parallel)
    if compile:
        compile_for_training(stepper.model, config.train)
    writes = not expert_parallel or dist.get_rank() == 0
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(config.toml())
    _train_loop(stepper, corpus, config, out, whole, progress and writes)
    if writes:
        plot_losses(out, data.baselines(corpus))
    return stepper.model


def _stepper(config: RunConfig, start: Start, corpus: data.ByteCorpus, extend: bool, device,
             model_factory: Callable, expert_parallel: bool) -> Stepper:
    """The run's :class:`Stepper` at ``start``: the checkpoint's weights loaded into the one-process model before
    its experts are spread over the ranks, then the optimizer, schedule, RNG and step (on P ranks each rank's
    block of the experts' moments); ``extend``: the schedule of the new total from the checkpoint's step."""
    def restored(model_config: K3Config, seed: int, device) -> torch.nn.Module:
        model = model_factory(model_config, seed, device)
        if start.folder is not None:
            checkpoint.load_weights(start.folder, model)
        return model

    stepper = Stepper(config.model, config.train, text_batches(corpus.train, config.train, device), device,
                      autocast=DTYPES[config.run.dtype], expert_parallel=expert_parallel, model_factory=restored)
    if start.folder is not None:
        shard = functools.partial(distributed.shard_optimizer_state, stepper.model, stepper.optimizer)
        stepper.steps_taken = checkpoint.load_state(start.folder, stepper.optimizer, stepper.scheduler,
                                                    shard if expert_parallel else None)
    if extend:
        stepper.scheduler = make_scheduler(stepper.optimizer, config.train, stepper.steps_taken)
    return stepper


def _due(step: int, every: int, last: int) -> bool:
    """Whether an evaluation / checkpoint on an ``every``-step schedule (0: only at the end) falls on ``step``."""
    return step == last or bool(every and step % every == 0)


def _train_loop(stepper: Stepper, corpus: data.ByteCorpus, config: RunConfig, out: Path, whole: dict,
                progress: bool) -> None:
    """Steps ``stepper.steps_taken`` → ``train.steps`` (see :func:`train_run`); on P ranks rank 0 writes."""
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
                save_checkpoint(stepper, out, whole, config)
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


def save_checkpoint(stepper: Stepper, out: Path, whole: dict, config: RunConfig) -> Path | None:
    """The one-process checkpoint of ``stepper``'s step in ``out`` (:func:`checkpoint.save_checkpoint`).

    On P ranks every rank calls it: the experts' blocks and their optimizer moments are gathered (collectives)
    and rank 0 writes them through a one-process model and optimizer, built with the RNG left as it was.
    Returns the folder (None on the other ranks)."""
    step = stepper.steps_taken
    if not stepper.expert_parallel:
        return checkpoint.save_checkpoint(out, step, stepper.model, stepper.optimizer, stepper.scheduler, whole)
    weights = distributed.gather_state_dict(stepper.model)
    optimizer_state = distributed.gather_optimizer_state(stepper.model, stepper.optimizer)
    if dist.get_rank() != 0:
        return None
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        single = build_model(config.model, config.train.seed)
    single.load_state_dict(weights)
    optimizer, scheduler = make_optimizer(single, config.train)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(stepper.scheduler.state_dict())
    return checkpoint.save_checkpoint(out, step, single, optimizer, scheduler, whole)


def plot_losses(out: Path, baselines: dict[str, float] | None = None) -> Path:
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
