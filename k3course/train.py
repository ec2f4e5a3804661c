"""Training K3 on bytes (the stdlib's or yours): AdamW, warmup + cosine, clipping, accumulation, MoE balancing, exact
resume.

One optimizer step:

    for each of the A micro-batches (inputs, targets) [B, T]:   loss_j = model(inputs, targets)   (nats/byte)
        backward(loss_j / A)                                    gradients of the mean over A·B·T bytes
    clip ‖g‖₂ to grad_clip;  AdamW step at lr(step);  zero the gradients
    for each MoE layer: read its routing statistics, then update_bias()   (all A micro-batches since the last)

The learning rate is lr · f(step) with a linear warmup and a cosine decay to ``min_lr_ratio · lr``:

    f(s) = (s + 1) / W                                          s < W
    f(s) = r + (1 − r) · ½ (1 + cos(π (s − W) / (S − W)))       W ≤ s < S        (r = min_lr_ratio)

Micro-batch j of step s is window batch number s·A + j of the seeded stream (:func:`k3course.data.batch_at`),
so the data position is a function of the step: a run resumed from a checkpoint (weights, optimizer,
scheduler, RNG, step) continues exactly as if it had never stopped. Bits per byte = loss / ln 2.

The same step runs on P ranks when the model's experts are expert-parallel
(:func:`k3course.distributed.parallelize_experts`): each rank reads its 1/P of every micro-batch, and the
gradients are averaged over the ranks and clipped by the norm of the whole gradient
(:mod:`k3course.distributed.data_parallel`), so the step is the one-process step on the concatenated batch.
``k3course train --ep P`` spawns P local ranks; ``python -m k3course.train`` is one rank under torchrun.

A run is configured whole by a :class:`RunConfig`: the model (:class:`K3Config`), the training
(:class:`TrainConfig`) and the run's data and precision (:class:`RunOptions`), resolved from a preset, a TOML
file and ``--set`` overrides (:func:`resolve_config`) and stored in the run folder. ``resume`` continues an
interrupted run exactly (SIGINT / SIGTERM stop it at a step boundary with a checkpoint); ``extend`` trains a run
on to more steps on a new schedule tail (:func:`run`).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import json
import math
import os
import shlex
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from k3course import checkpoint, data, distributed
from k3course.config import (
    K3Config,
    check_field_names,
    field_types,
    toml_document,
    toml_text,
    value_from_text,
    with_settings,
)
from k3course.debug import progress_bar

LN2 = math.log(2)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class TrainConfig:
    """How to train: ``steps`` optimizer steps of ``grad_accum`` micro-batches of ``batch_size × seq_len`` bytes.

    Evaluation every ``eval_every`` steps on ``eval_bytes`` validation bytes (and at the end); a checkpoint
    every ``checkpoint_every`` steps (and at the end); 0 turns either off (except at the end).
    """

    steps: int = 800
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_bytes: int = 131072
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
        for name in ("warmup_steps", "eval_every", "eval_bytes", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int ≥ 0, got {value!r}")
        for name, low, high, bounds in (("lr", 0, math.inf, "> 0"), ("min_lr_ratio", 0, 1, "in [0, 1]"),
                                        ("weight_decay", 0, math.inf, "≥ 0"), ("grad_clip", 0, math.inf, "> 0")):
            value = getattr(self, name)
            if not _is_number(value) or not low <= value <= high or (bounds == "> 0" and value == 0):
                raise ValueError(f"{name} must be a number {bounds}, got {value!r}")
        if not isinstance(self.betas, tuple) or len(self.betas) != 2 or \
                not all(_is_number(b) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.grad_accum * self.batch_size * self.seq_len

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)


# The training presets: a model preset (:meth:`K3Config.preset`) and how to train it. "tiny" is the default run,
# sized for ≤ 10 minutes on 2 CPU cores; "small" is sized for one GPU.
TRAIN_PRESETS: dict[str, tuple[str, TrainConfig]] = {
    "tiny": ("tiny", TrainConfig()),
    "small": ("small", TrainConfig(steps=5000, batch_size=32, seq_len=512, lr=2e-3, warmup_steps=200,
                                   eval_every=500, eval_bytes=1 << 20, checkpoint_every=1000)),
}


def train_preset(name: str) -> tuple[K3Config, TrainConfig]:
    """(model config, training config) of a training preset (one of :data:`TRAIN_PRESETS`)."""
    if name not in TRAIN_PRESETS:
        raise ValueError(f"name: unknown training preset {name!r}; choose one of {', '.join(TRAIN_PRESETS)}")
    model_preset, train_config = TRAIN_PRESETS[name]
    return K3Config.preset(model_preset), train_config


# --- a run's whole configuration: [model], [train], [run]; TOML files and --set overrides ---------------

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}  # run.dtype -> the autocast dtype (None: no autocast)


@dataclass(frozen=True)
class RunOptions:
    """What a run reads and at what precision.

    ``data``: files, folders and globs of text (``()``: the stdlib corpus); ``val``: validation files (``()``:
    ``data`` is split by file hash, as the stdlib is); ``dtype``: "float32", or "bfloat16" (the forward under
    autocast; master weights, optimizer state and the KDA recurrent states stay float32).
    """

    data: tuple[str, ...] = ()
    val: tuple[str, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("data", "val"):
            paths = getattr(self, name)
            if not isinstance(paths, tuple) or not all(isinstance(p, str) and p for p in paths):
                raise ValueError(f"{name} must be a list of paths (files, folders, globs), got {paths!r}")
        if self.val and not self.data:
            raise ValueError("val names validation files for your own data: give data too (or neither: the stdlib)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class RunConfig:
    """A run's whole configuration: the tables [model] (:class:`K3Config`), [train] (:class:`TrainConfig`) and
    [run] (:class:`RunOptions`) of its TOML file."""

    model: K3Config
    train: TrainConfig
    run: RunOptions = RunOptions()

    def sections(self) -> dict[str, object]:
        return {"model": self.model, "train": self.train, "run": self.run}

    def as_dict(self) -> dict[str, dict]:
        """{"model": {...}, "train": {...}, "run": {...}}: what config.json stores (JSON lists for tuples)."""
        return {name: dataclasses.asdict(section) for name, section in self.sections().items()}

    def toml(self) -> str:
        """The whole configuration as TOML, every field: ``k3course train --config`` reads it back."""
        return "# k3course run configuration: k3course train --config THIS_FILE\n\n" + toml_text(self.sections())


SECTIONS = {"model": K3Config, "train": TrainConfig, "run": RunOptions}


def read_config_file(path: Path | str) -> dict:
    """The TOML document of ``k3course train --config PATH``: optional ``preset = "NAME"`` and the tables
    [model], [train], [run]; anything else is an error naming the key (and the table a field belongs in)."""
    path = Path(path)
    try:
        document = toml_document(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"config: no file at {path}") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"config: {path}: {error}") from error
    for key, value in document.items():
        if key == "preset" and isinstance(value, str) or key in SECTIONS and isinstance(value, dict):
            continue
        owner = _section_of(key)
        hint = f"; it belongs in the [{owner}] table" if owner else '; expected preset = "NAME" or a table'
        raise ValueError(f"config: {path}: unexpected top-level key {key!r}{hint}")
    return document


def _section_of(field_name: str) -> str | None:
    """The one section that has a field named ``field_name`` (None when none has)."""
    owners = [name for name, cls in SECTIONS.items() if field_name in field_types(cls)]
    return owners[0] if len(owners) == 1 else None


def parse_set(text: str) -> tuple[str, str, object]:
    """``--set section.field=VALUE`` (or ``field=VALUE`` for a field name that one section has) ->
    (section, field, value of the field's type); errors quote the ``--set`` and name what was expected."""
    key, equals, value = text.partition("=")
    section, _, name = key.strip().rpartition(".")
    if not equals or not name:
        raise ValueError(f"--set {text}: expected section.field=value, e.g. --set train.lr=1e-3")
    owner = _section_of(name)
    section = section or owner or ""
    if section not in SECTIONS:
        raise ValueError(f"--set {text}: no section has a field {name!r}; --print-config lists every field")
    if name not in field_types(SECTIONS[section]) and owner:
        raise ValueError(f"--set {text}: {name} is a field of [{owner}]: --set {owner}.{name}={value}")
    check_field_names(SECTIONS[section], [name], section, f"--set {text}")
    try:
        return section, name, value_from_text(field_types(SECTIONS[section])[name], value.strip(), f"{section}.{name}")
    except ValueError as error:
        raise ValueError(f"--set {text}: {error}") from None


def _apply(config: RunConfig, tables: dict[str, dict], where: str) -> RunConfig:
    """``config`` with the fields of ``tables`` {section: {field: value}} set (converted, validated)."""
    sections = config.sections()
    for section, settings in tables.items():
        if settings:
            sections[section] = with_settings(sections[section], settings, section, where)
    return RunConfig(**sections)


def _absolute_paths(options: RunOptions) -> RunOptions:
    """Data paths made absolute (``~`` expanded; globs kept), so the run folder works from any directory."""
    absolute = lambda paths: tuple(os.path.abspath(os.path.expanduser(p)) for p in paths)
    return dataclasses.replace(options, data=absolute(options.data), val=absolute(options.val))


def resolve_config(preset: str | None = None, config_file: Path | str | None = None,
                   flags: Sequence[tuple[str, str, object]] = (), sets: Sequence[str] = (),
                   base: RunConfig | None = None) -> RunConfig:
    """The run configuration, in this order, later wins: the training preset (``preset``, else the config file's
    ``preset``, else "tiny"; or ``base``, a saved run's, when no preset is named), the config file's tables,
    ``flags`` [(flag, "section.field", value), ...] (``--steps``, ``--data``, ...), then ``--set`` texts.
    Every value is converted to its field's type and validated; errors name the source and the field."""
    document = read_config_file(config_file) if config_file is not None else {}
    named = preset or document.get("preset")
    if named is not None or base is None:
        config = RunConfig(*train_preset(named or "tiny"))
    else:
        config = base
    config = _apply(config, {name: document.get(name, {}) for name in SECTIONS}, f"config {config_file}")
    for flag, key, value in flags:
        section, name = key.split(".")
        config = _apply(config, {section: {name: value}}, flag)
    tables: dict[str, dict] = {name: {} for name in SECTIONS}
    for text in sets:
        section, name, value = parse_set(text)
        tables[section][name] = value
    config = _apply(config, tables, "--set")
    return dataclasses.replace(config, run=_absolute_paths(config.run))


def saved_run_config(folder: Path) -> RunConfig:
    """The RunConfig a checkpoint was trained with (a checkpoint without [run] read the stdlib in float32)."""
    saved = checkpoint.read_config(folder)
    plain = lambda values: {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        train, options = TrainConfig(**plain(saved["train"])), RunOptions(**plain(saved.get("run", {})))
    except (TypeError, ValueError, KeyError) as error:
        message = f"checkpoint: {folder}/config.json has no valid run settings: {error}"
        raise checkpoint.CheckpointError(message) from error
    return RunConfig(saved["model"], train, options)


# --- schedule, step, evaluation ------------------------------------------------------------------------

def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """f(step): linear warmup over ``warmup_steps``, then cosine from 1 down to ``min_lr_ratio`` at the end."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, train: TrainConfig) -> tuple[torch.optim.Optimizer, object]:
    """AdamW over ``model.param_groups(weight_decay)`` and its warmup + cosine LambdaLR scheduler."""
    optimizer = torch.optim.AdamW(model.param_groups(train.weight_decay), lr=train.lr, betas=train.betas)
    return optimizer, make_scheduler(optimizer, train)


def make_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig, step: int = 0):
    """The warmup + cosine LambdaLR of ``train.steps`` steps, placed at ``step``: the next optimizer step runs at
    lr · f(step) (``step`` > 0 needs an optimizer that a scheduler has driven before: its groups' initial_lr)."""
    factor = functools.partial(lr_factor, warmup_steps=train.warmup_steps, total_steps=train.steps,
                               min_lr_ratio=train.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=step - 1)


def balance_experts(model: torch.nn.Module) -> dict:
    """Routing statistics of every MoE layer over the micro-batches since the last call, then ``update_bias()``
    (with expert-parallel experts both pool all ranks' routing: collectives).

    Returns {"max_violation": the worst layer's max_j load_j / mean load − 1, "max_violation_per_layer": [...]}.
    """
    per_layer = []
    for moe in model.moe_layers():
        per_layer.append(float(moe.load_statistics()["max_violation"]))
        moe.update_bias()
    return {"max_violation": max(per_layer, default=0.0), "max_violation_per_layer": per_layer}


def forward_precision(device: torch.device, autocast: torch.dtype | None):
    """The context the forward runs in: ``torch.autocast`` to ``autocast`` on ``device`` (None: nothing).

    Under autocast the weights stay float32 (the optimizer updates them there), matrix products run in the
    autocast dtype, and the KDA ops keep their recurrence and state in float32 (:mod:`k3course.ops.checks`).
    """
    if autocast is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    # torch notes once that RMSNorm of a bf16 input with fp32 weights skips its fused kernel: expected here
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    stack.enter_context(torch.autocast(torch.device(device).type, dtype=autocast))
    return stack


def train_step(model: torch.nn.Module, optimizer, scheduler, micro_batches, grad_clip: float,
               autocast: torch.dtype | None = None) -> dict:
    """One optimizer step over ``micro_batches`` [(inputs [B, T], targets [B, T]), ...]; see the module docstring.
    ``autocast`` (e.g. torch.bfloat16) runs the forward passes under autocast (:func:`forward_precision`).

    With expert-parallel experts every rank calls it together with its own shard of each micro-batch: the
    gradients are then averaged over the ranks and clipped by the global norm, the loss averaged over the
    ranks, and the balancing statistics pooled, so every rank gets the one-process numbers of the whole batch.
    Returns {"loss": mean micro-batch loss, "lr": the rate this step used, "grad_norm": ‖g‖₂ before clipping,
    "max_violation", "max_violation_per_layer"}.
    """
    model.train()
    total = torch.zeros((), dtype=torch.float64)  # the reported loss is summed in float64
    for inputs, targets in micro_batches:
        with forward_precision(inputs.device, autocast):
            _, loss, _ = model(inputs, targets=targets)
        (loss / len(micro_batches)).backward()
        total += loss.detach().double().cpu()
    if distributed.expert_parallel_layers(model):  # P ranks: everything but the routed experts is data-parallel
        distributed.average_gradients(model)
        grad_norm = distributed.clip_global_grad_norm(model, grad_clip)
        total = distributed.average_over_ranks(total, model)
    else:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total.item() / len(micro_batches), "lr": lr, "grad_norm": grad_norm, **balance_experts(model)}


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int,
             autocast: torch.dtype | None = None) -> float:
    """Mean next-byte cross-entropy (nats per byte) over ``windows`` [N, T + 1], in eval mode (bias frozen),
    the forward under ``autocast`` when given. Computed from the logits (in float32), so auxiliary balancing
    losses never enter a validation number.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        with forward_precision(device, autocast):
            logits, _, _ = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train(was_training)
    return total / count


# --- a whole run ---------------------------------------------------------------------------------------

def _check_out(out: Path, resume: bool) -> Path | None:
    """Validate ``out``; return the checkpoint to resume from (None for a fresh run)."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out: {out} is a file, not a folder for checkpoints")
    latest = checkpoint.latest_checkpoint(out)
    if resume and latest is None:
        raise FileNotFoundError(f"out: no checkpoint to resume in {out}")
    if not resume and latest is not None:
        raise FileExistsError(f"out: {out} already holds checkpoints ({latest.name}); resume or use another out")
    return latest if resume else None


def _differences(saved: RunConfig, config: RunConfig) -> list[str]:
    """``section.field=saved value`` for every field in which ``config`` differs from ``saved``."""
    return [f"{section}.{f.name}={getattr(old, f.name)!r}" for section, old in saved.sections().items()
            for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(config.sections()[section], f.name)]


def _check_resume(folder: Path, config: RunConfig, extend: bool) -> None:
    """A run continues only with its own settings (``extend``: all but ``train.steps``); errors name them."""
    differ = [d for d in _differences(saved_run_config(folder), config)
              if not (extend and d.startswith("train.steps="))]
    if differ:
        hint = "; to train a run further than its steps, use --extend-to N" if any(
            d.startswith("train.steps=") for d in differ) else ""
        raise ValueError(f"train: resuming needs the run's own settings; these differ from {folder}: "
                         f"{', '.join(differ)}{hint}")


def compile_for_training(model: torch.nn.Module, train: TrainConfig, **compile_options) -> torch.nn.Module:
    """``torch.compile`` the model in place (``nn.Module.compile``: the same parameters and state_dict keys) for
    training with ``train``'s micro-batches: each MoE layer's routing record is first sized for one optimizer
    step's tokens (:meth:`~k3course.moe.MoE.reserve_statistics`), so the compiled forward has fixed shapes. The
    first step compiles (each of its micro-batches at most once: the record's write position is part of the
    graph); later steps reuse those graphs, with no graph break anywhere (tests/test_train.py reads dynamo's
    counters). ``compile_options`` go to ``torch.compile`` (e.g. ``backend="aot_eager"``). Returns the model."""
    for moe in model.moe_layers():
        moe.reserve_statistics(train.tokens_per_step)
    model.compile(**compile_options)
    return model


def build_model(model_config: K3Config, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A freshly initialised K3Model, seeded (same seed, same weights)."""
    from k3course.model import K3Model

    torch.manual_seed(seed)
    return K3Model.from_config(model_config, device=device)


def _micro_batches(tokens, step: int, train: TrainConfig, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    first = step * train.grad_accum
    batches = [data.batch_at(tokens, first + j, train.batch_size, train.seq_len, train.seed)
               for j in range(train.grad_accum)]
    return [(inputs.to(device), targets.to(device)) for inputs, targets in batches]


def text_batches(tokens: torch.Tensor, train: TrainConfig, device: torch.device | str = "cpu"
                 ) -> Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Step i → its ``grad_accum`` micro-batches of ``tokens`` [(inputs [B, T], targets [B, T])] on ``device``:
    :func:`k3course.data.batch_at` windows i·grad_accum + j with ``train``'s batch shape and seed."""
    return functools.partial(_micro_batches, tokens, train=train, device=device)


class Stepper:
    """A freshly seeded model of ``model_config`` (:func:`build_model`) with its optimizer and schedule
    (:func:`make_optimizer`), trained one optimizer step per call on ``batches(i)`` for i = 0, 1, 2, …

    ``stepper()`` returns :func:`train_step`'s record. The loop of every short run outside ``k3course train``:
    chapter 12's claims, ``bench train``, the probes and the capstone.
    """

    def __init__(self, model_config: K3Config, train: TrainConfig, batches: Callable[[int], list],
                 device: torch.device | str = "cpu"):
        self.model = build_model(model_config, train.seed, device)
        self.optimizer, self.scheduler = make_optimizer(self.model, train)
        self.train, self.batches, self.steps_taken = train, batches, 0

    def __call__(self) -> dict:
        batches = self.batches(self.steps_taken)
        record = train_step(self.model, self.optimizer, self.scheduler, batches, self.train.grad_clip)
        self.steps_taken += 1
        return record


def rank_shards(micro_batches, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s 1/P of the rows of every micro-batch [(inputs [B, T], targets [B, T]), ...]."""
    return [(inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]) for inputs, targets in micro_batches]


class _Metrics:
    """metrics.jsonl in ``out``: one JSON object per line; on resume, lines after the checkpoint are dropped."""

    def __init__(self, out: Path, keep_until: int):
        self.path = out / "metrics.jsonl"
        kept = [r for r in self.read(out) if r["step"] <= keep_until] if keep_until else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    @staticmethod
    def read(out: Path) -> list[dict]:
        path = Path(out) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def write(self, record: dict) -> None:
        with self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")


def plot_losses(out: Path, baselines: dict[str, float] | None = None) -> Path:
    """loss.png in ``out``: training and validation bits/byte against step, n-gram baselines as lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = _Metrics.read(out)
    figure = Figure(figsize=(7, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    steps = [r["step"] for r in records if "loss" in r]
    axes.plot(steps, [r["loss"] / LN2 for r in records if "loss" in r], lw=0.8, label="train (incl. aux)")
    evals = [r for r in records if "val_bpb" in r]
    axes.plot([r["step"] for r in evals], [r["val_bpb"] for r in evals], "o-", label="validation")
    for (name, value), style in zip((baselines or {}).items(), (":", "--", "-.", (0, (1, 4)))):
        axes.axhline(value, color="gray", ls=style, lw=1, label=name)
    axes.set(xlabel="optimizer step", ylabel="bits per byte", ylim=(0, 8))
    axes.legend(fontsize=8)
    path = Path(out) / "loss.png"
    figure.savefig(path, dpi=100)
    return path


class TrainingInterrupted(Exception):
    """A run stopped by SIGINT or SIGTERM at a step boundary, after writing the checkpoint of that step."""

    def __init__(self, signum: int, step: int, out: Path):
        self.signum, self.step, self.out = signum, step, out
        super().__init__(f"train: {signal.Signals(signum).name} at step {step}: checkpoint "
                         f"{checkpoint.step_dir(out, step)} written; resume exactly with: "
                         f"k3course train --out {shlex.quote(str(out))} --resume")


class _StopOnSignal:
    """While entered (in the main thread): SIGINT / SIGTERM are noted in ``received`` and the step in progress
    finishes; the previous handlers come back at once, so a second signal acts as it did before."""

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


def run_corpus(options: RunOptions) -> data.ByteCorpus:
    """The bytes a run reads: your text (``options.data``, ``options.val``) or, by default, the stdlib's."""
    return data.text_corpus(options.data, options.val) if options.data else data.stdlib_corpus()


def _check_corpus(corpus: data.ByteCorpus, model_config: K3Config, train: TrainConfig) -> None:
    """Bytes need a vocabulary of 256, and each split at least one window of seq_len + 1 bytes (+ 1 to draw)."""
    if model_config.vocab_size < 256:
        raise ValueError(f"model.vocab_size must be ≥ 256 to train on bytes, got {model_config.vocab_size}")
    for split, need in (("train", train.seq_len + 2), ("val", train.seq_len + 1)):
        if len(corpus.split(split)) < need:
            raise ValueError(f"data: the {split} split holds {len(corpus.split(split))} bytes; train.seq_len = "
                             f"{train.seq_len} needs at least {need}")


def _start(out: Path, config: RunConfig, resume: bool, extend: bool) -> tuple[Path | None, dict]:
    """The checkpoint to continue from (None: a fresh run) and its saved config dict ({} for a fresh run)."""
    start_from = _check_out(out, resume or extend)
    if start_from is None:
        return None, {}
    _check_resume(start_from, config, extend)
    return start_from, checkpoint.read_config(start_from)


def _check_same_corpus(saved: dict, corpus: data.ByteCorpus, folder: Path) -> None:
    """A resumed run reads the bytes it began with (the corpus key hashes the files' list, sizes and times)."""
    before = saved.get("corpus", {}).get("key", corpus.meta["key"])
    if before != corpus.meta["key"]:
        raise ValueError(f"data: the files changed since {folder} was written (corpus {before} is now "
                         f"{corpus.meta['key']}): resuming would not be exact; --extend-to N trains on the new bytes")


def _extension(saved: dict, step: int, train: TrainConfig) -> list[dict]:
    """The run's extensions so far plus this one: ``{"at_step", "steps_before", "steps_after"}`` each."""
    before = saved["train"]["steps"]
    if train.steps <= step:
        raise ValueError(f"extend_to: must be more than the run's step {step}, got {train.steps}")
    return [*saved.get("extensions", []), {"at_step": step, "steps_before": before, "steps_after": train.steps}]


def run(model_config: K3Config, train: TrainConfig, out: Path | str, resume: bool = False,
        corpus: data.ByteCorpus | None = None, device: torch.device | str = "cpu", progress: bool = True,
        model_factory: Callable[[K3Config, int, object], torch.nn.Module] = build_model,
        options: RunOptions = RunOptions(), extend: bool = False, compile: bool = False) -> torch.nn.Module:
    """Train (or resume) a run in ``out``: config.toml, metrics.jsonl, loss.png and step-NNNNNN/ checkpoints.
    Returns the model.

    ``resume=True`` continues from the latest checkpoint in ``out`` up to ``train.steps``, exactly as if it had
    never stopped (the settings and the corpus must be the saved ones). ``extend=True`` continues it to a new
    total ``train.steps`` (all other settings the saved ones) on a new schedule tail: from the current step the
    learning rate follows the warmup + cosine of a ``train.steps``-step run, which is NOT a straight run of that
    many steps (its first steps followed the old, shorter cosine). ``resume=extend=False`` refuses an ``out``
    that already holds checkpoints. ``options``: the data and the precision (:class:`RunOptions`); ``corpus``
    overrides the data. SIGINT / SIGTERM stop the run at the next step boundary with a checkpoint
    (:class:`TrainingInterrupted`). ``compile``: train the model compiled (:func:`compile_for_training`); the same
    steps to fp32 rounding, so a run may be resumed with or without it.
    """
    out = Path(out)
    config = RunConfig(model_config, train, options)
    start_from, saved = _start(out, config, resume, extend)
    corpus = corpus or run_corpus(options)
    _check_corpus(corpus, model_config, train)
    if start_from is not None and not extend:
        _check_same_corpus(saved, corpus, start_from)
    out.mkdir(parents=True, exist_ok=True)
    model = model_factory(model_config, train.seed, device)
    optimizer, scheduler = make_optimizer(model, train)
    step = 0
    if start_from is not None:
        checkpoint.load_weights(start_from, model)
        step = checkpoint.load_state(start_from, optimizer, scheduler)
    extensions = _extension(saved, step, train) if extend else saved.get("extensions", [])
    if extend:
        scheduler = make_scheduler(optimizer, train, step)
    if compile:
        compile_for_training(model, train)
    whole = {**config.as_dict(), "corpus": {"key": corpus.meta["key"], "splits": corpus.meta["splits"]},
             "extensions": extensions}
    (out / "config.toml").write_text(config.toml())
    _train_loop(model, optimizer, scheduler, corpus, config, out, step, whole, device, progress)
    plot_losses(out, data.baselines(corpus))
    return model


def _train_loop(model, optimizer, scheduler, corpus, config: RunConfig, out: Path, step: int, whole: dict,
                device, progress: bool) -> None:
    """Steps ``step`` → ``train.steps``: metrics every step, evaluations and checkpoints on their schedule and
    at the end; on SIGINT / SIGTERM a checkpoint at the next step boundary, then :class:`TrainingInterrupted`."""
    train, autocast = config.train, DTYPES[config.run.dtype]
    metrics = _Metrics(out, keep_until=step)
    windows = data.eval_windows(corpus.val, train.seq_len, train.eval_bytes)
    bar = progress_bar(total=train.steps, initial=step, disable=not progress, desc="train", unit="step")
    with _StopOnSignal() as stop:
        while step < train.steps:
            began = time.perf_counter()
            record = train_step(model, optimizer, scheduler, _micro_batches(corpus.train, step, train, device),
                                train.grad_clip, autocast)
            step += 1
            record = {"step": step, **record, "tokens_per_s": train.tokens_per_step / (time.perf_counter() - began)}
            if step == train.steps or (train.eval_every and step % train.eval_every == 0):
                record["val_loss"] = evaluate(model, windows, train.batch_size, autocast)
                record["val_bpb"] = record["val_loss"] / LN2
            metrics.write(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                            max_viol=f"{record['max_violation']:.2f}", **({"val_bpb": f"{record['val_bpb']:.3f}"}
                                                                           if "val_bpb" in record else {}))
            due = step == train.steps or (train.checkpoint_every and step % train.checkpoint_every == 0)
            if due or stop.received:
                checkpoint.save_checkpoint(out, step, model, optimizer, scheduler, whole)
            if stop.received and step < train.steps:
                bar.close()
                raise TrainingInterrupted(stop.received, step, out)
    bar.close()


# --- generation ----------------------------------------------------------------------------------------

def load_model(path: Path | str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model of a checkpoint folder, or of the latest checkpoint of a run folder, in eval mode."""
    folder = checkpoint.find_checkpoint(path)
    config = checkpoint.read_config(folder)
    from k3course.model import K3Model

    model = K3Model.from_config(config["model"], device=device)
    checkpoint.load_weights(folder, model)
    return model.eval()


def _prompt_tokens(model: torch.nn.Module, prompt: str) -> torch.Tensor:
    """The prompt's UTF-8 bytes as tokens [1, n] on the model's device; a non-UTF-8 or empty prompt is an error."""
    try:
        prompt_bytes = prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"prompt: not valid UTF-8 text ({error.reason} at position {error.start})") from error
    if not prompt_bytes:
        raise ValueError("prompt: must not be empty (the model needs at least one byte to continue)")
    return torch.tensor([list(prompt_bytes)], dtype=torch.int64, device=next(model.parameters()).device)


def stream_text(model: torch.nn.Module, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                top_k: int | None = None, seed: int = 0) -> Iterator[str]:
    """The prompt, then its continuation as it is sampled, byte by byte, as text pieces (a character of several
    bytes comes once it is complete; bytes that are not valid UTF-8 come as U+FFFD). Arguments are checked at
    the call."""
    tokens = _prompt_tokens(model, prompt)
    sampled = model.stream(tokens, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return _decoded(prompt, sampled)


def _decoded(prompt: str, sampled: Iterator[torch.Tensor]) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    yield prompt
    for token in sampled:
        yield decoder.decode(bytes([int(token)]))
    yield decoder.decode(b"", final=True)


def generate_text(model: torch.nn.Module, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = None, seed: int = 0) -> str:
    """The prompt continued byte by byte; bytes that are not valid UTF-8 are shown as U+FFFD."""
    return "".join(stream_text(model, prompt, max_new_tokens, temperature, top_k, seed))


# --- the command line (k3course train / generate) ------------------------------------------------------

def configure(preset_name: str | None = None, out: Path | str | None = None, config_file: Path | str | None = None,
              flags: Sequence[tuple[str, str, object]] = (), sets: Sequence[str] = (), resume: bool = False,
              extend_to: int | None = None) -> tuple[RunConfig, Path]:
    """The configuration ``k3course train`` runs (:func:`resolve_config`) and its folder (default
    ``runs/PRESET``). With ``resume`` or ``extend_to`` the run's saved configuration is the base unless a preset
    is named; ``extend_to`` N sets ``train.steps`` = N."""
    out = Path(out) if out is not None else Path("runs") / (preset_name or "tiny")
    if resume and extend_to is not None:
        raise ValueError("--extend-to: --resume continues a run as it was and --extend-to gives it more steps; "
                         "use one")
    if extend_to is not None and any(key == "train.steps" for _, key, _ in flags):
        raise ValueError(f"--steps: with --extend-to {extend_to} the run's new total is {extend_to}; leave out --steps")
    base = saved_run_config(_check_out(out, resume=True)) if resume or extend_to is not None else None
    if extend_to is not None:
        flags = [*flags, ("--extend-to", "train.steps", extend_to)]
    return resolve_config(preset_name, config_file, flags, sets, base), out


def train_command(preset_name: str | None = None, out: Path | str | None = None, *,
                  config_file: Path | str | None = None, flags: Sequence[tuple[str, str, object]] = (),
                  sets: Sequence[str] = (), resume: bool = False, extend_to: int | None = None, device: str = "cpu",
                  progress: bool = True, notice: Callable[[str], None] | None = None, compile: bool = False) -> dict:
    """``k3course train``: the run :func:`configure` describes, in its folder; returns a summary dict (out, step,
    val_bpb, seconds, baselines of the run's data, started_at: the step it began from, config).

    ``resume`` continues an interrupted run exactly; ``extend_to`` N trains a run on to step N on a new schedule
    tail (see :func:`run`), and ``notice`` (e.g. print) is told so before training starts. ``compile``: train
    the model compiled (``--compile``, :func:`compile_for_training`).
    """
    config, out = configure(preset_name, out, config_file, flags, sets, resume, extend_to)
    latest = checkpoint.latest_checkpoint(out) if resume or extend_to is not None else None
    started_at = checkpoint.checkpoints(out)[-1][0] if latest is not None else 0
    if extend_to is not None and notice is not None:
        notice(f"extending {out} from step {started_at} to {extend_to}: a new schedule tail (from here the learning "
               f"rate follows the warmup + cosine of a {extend_to}-step run); not the same as a straight "
               f"{extend_to}-step run")
    began = time.perf_counter()
    corpus = run_corpus(config.run)
    run(config.model, config.train, out, resume, corpus, device, progress, options=config.run,
        extend=extend_to is not None, compile=compile)
    final = _Metrics.read(out)[-1]
    return {"out": str(out), "step": final["step"], "val_bpb": final.get("val_bpb"), "started_at": started_at,
            "seconds": time.perf_counter() - began, "baselines": data.baselines(corpus), "config": config}


def generate_command(checkpoint_path: Path | str, prompt: str, max_new_tokens: int = 200,
                     temperature: float = 0.8, top_k: int | None = None, seed: int = 0) -> Iterator[str]:
    """``k3course generate``: the prompt continued by the model of a checkpoint (or a run's latest), as the
    text pieces of :func:`stream_text` (join them for the whole text)."""
    model = load_model(checkpoint_path)
    return stream_text(model, prompt, max_new_tokens, temperature, top_k, seed)


# --- expert-parallel runs (k3course train --ep P, torchrun) --------------------------------------------

def train_ranks(rank: int, world_size: int, config: RunConfig, out: str,
                device: torch.device | str = "cpu") -> list[dict]:
    """One rank of an expert-parallel run: :func:`train_step` with the MoE layers' experts spread over the
    ranks, each rank reading its 1/P of every micro-batch of the one-process run. Rank 0 writes metrics.jsonl
    after every step and, at the end, one single-process checkpoint (weights and optimizer gathered) that
    ``k3course generate`` and a one-process ``--resume`` can load. Returns the per-step records."""
    model_config, train_config = config.model, config.train
    if train_config.batch_size % world_size:
        raise ValueError(f"--ep {world_size} must divide train.batch_size {train_config.batch_size}")
    corpus = run_corpus(config.run)
    model = distributed.parallelize_experts(build_model(model_config, train_config.seed, device))
    optimizer, scheduler = make_optimizer(model, train_config)
    out = Path(out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(config.toml())
        metrics = _Metrics(out, keep_until=0)
    records = []
    for step in range(train_config.steps):
        shards = rank_shards(_micro_batches(corpus.train, step, train_config, device), rank, world_size)
        records.append({"step": step + 1, **train_step(model, optimizer, scheduler, shards, train_config.grad_clip,
                                                       DTYPES[config.run.dtype])})
        if rank == 0:
            metrics.write(records[-1])
    weights = distributed.gather_state_dict(model)
    optimizer_state = distributed.gather_optimizer_state(model, optimizer)
    if rank == 0:
        single = build_model(model_config, train_config.seed)
        single.load_state_dict(weights)
        single_optimizer, single_scheduler = make_optimizer(single, train_config)
        single_optimizer.load_state_dict(optimizer_state)
        single_scheduler.load_state_dict(scheduler.state_dict())
        whole = {**config.as_dict(), "corpus": {"key": corpus.meta["key"], "splits": corpus.meta["splits"]}}
        checkpoint.save_checkpoint(out, train_config.steps, single, single_optimizer, single_scheduler, whole)
    return records


def train_expert_parallel(config: RunConfig, world_size: int, out: Path | str) -> dict:
    """``k3course train --ep P``: spawn P local gloo ranks running :func:`train_ranks`; returns a summary.

    The corpus cache is built here first (the ranks then only memory-map it); ``out`` must hold no checkpoint.
    """
    out = Path(out)
    if checkpoint.latest_checkpoint(out) is not None:
        raise ValueError(f"out: {out} already holds checkpoints (expert-parallel runs do not resume)")
    run_corpus(config.run)
    records = distributed.run_ranks(train_ranks, world_size, config, str(out), timeout_s=7 * 24 * 3600)[0]
    return {"out": str(out), "step": records[-1]["step"], "loss": records[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    """``torchrun --standalone --nproc-per-node P -m k3course.train --ep P --preset tiny [--steps N]``: one rank
    of an expert-parallel run (gloo on CPU; NCCL with rank r on GPU r when every rank has a GPU); ``--out DIR``
    as in ``k3course train``."""
    import argparse
    import os

    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m k3course.train", description=main.__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=None)
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
    dist.init_process_group("gloo" if device == "cpu" else "nccl")
    rank = dist.get_rank()
    out = args.out or f"runs/{args.preset}-ep{world_size}"
    steps = [] if args.steps is None else [("--steps", "train.steps", args.steps)]
    records = train_ranks(rank, world_size, resolve_config(args.preset, flags=steps), out, device)
    if rank == 0:
        print(f"step {records[-1]['step']}: loss {records[-1]['loss']:.4f}; checkpoint and metrics.jsonl in {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # torchrun --nproc-per-node P -m k3course.train --ep P ...: one expert-parallel rank
    raise SystemExit(main())
