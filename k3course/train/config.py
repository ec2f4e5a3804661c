"""A run's whole configuration: the model (:class:`K3Config`), the training (:class:`TrainConfig`) and the run's
data and precision (:class:`RunOptions`) as one :class:`RunConfig`, resolved from a preset, a TOML file and
``--set`` overrides (:func:`resolve_config`), stored in the run folder as config.toml and in every checkpoint's
config.json.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3course import checkpoint, data
from k3course.config import (
    K3Config,
    check_field_names,
    field_types,
    from_saved_fields,
    toml_document,
    toml_text,
    value_from_text,
    with_settings,
)
from k3course.guards import is_number
from k3course.kernels import BACKENDS, kernel_backend


@dataclass(frozen=True)
class TrainConfig:
    """How to train: ``steps`` optimizer steps of ``grad_accum`` micro-batches of ``batch_size × seq_len`` bytes.

    ``gate_lr_scale``: the forget gates' parameters (the decay's projection, bias and rate, marked
    :func:`k3course.params.forget_gate`) train at that multiple of the learning rate, in parameter groups of their own.
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
    gate_lr_scale: float = 1.0
    eval_every: int = 200
    eval_bytes: int = 131072
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum"):
            value = getattr(self, name)
            if not is_number(value) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
        for name in ("warmup_steps", "eval_every", "eval_bytes", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ValueError(f"{name} must be an int ≥ 0, got {value!r}")
        for name, low, high, bounds in (("lr", 0, math.inf, "> 0"), ("min_lr_ratio", 0, 1, "in [0, 1]"),
                                        ("weight_decay", 0, math.inf, "≥ 0"), ("grad_clip", 0, math.inf, "> 0"),
                                        ("gate_lr_scale", 0, math.inf, "> 0")):
            value = getattr(self, name)
            if not is_number(value, int | float) or not low <= value <= high or (bounds == "> 0" and value == 0):
                raise ValueError(f"{name} must be a number {bounds}, got {value!r}")
        if not isinstance(self.betas, tuple) or len(self.betas) != 2 or \
                not all(is_number(b, int | float) and 0 <= b < 1 for b in self.betas):
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
    autocast; master weights, optimizer state and the KDA recurrent states stay float32); ``kernels``: the
    model's kernel backend (:data:`k3course.kernels.BACKENDS`; default: the environment variable
    ``K3COURSE_KERNELS`` when the options are made, else "auto"), saved with the run and used on resume.
    """

    data: tuple[str, ...] = ()
    val: tuple[str, ...] = ()
    dtype: str = "float32"
    kernels: str = field(default_factory=kernel_backend)

    def __post_init__(self) -> None:
        for name in ("data", "val"):
            paths = getattr(self, name)
            if not isinstance(paths, tuple) or not all(isinstance(p, str) and p for p in paths):
                raise ValueError(f"{name} must be a list of paths (files, folders, globs), got {paths!r}")
        if self.val and not self.data:
            raise ValueError("val names validation files for your own data: give data too (or neither: the stdlib)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kernels not in BACKENDS:
            raise ValueError(f"kernels must be one of {', '.join(BACKENDS)}, got {self.kernels!r}")


@dataclass(frozen=True)
class RunConfig:
    """A run's whole configuration: the tables [model] (:class:`K3Config`), [train] (:class:`TrainConfig`) and
    [run] (:class:`RunOptions`) of its TOML file."""

    model: K3Config
    train: TrainConfig
    run: RunOptions = field(default_factory=RunOptions)

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


@dataclass(frozen=True)
class SavedRun:
    """A checkpoint's config.json, read once (:func:`read_saved_run`): the RunConfig it was trained with, the
    optimizer steps it holds, the key of the corpus it read (None before corpora had keys) and the run's
    extensions so far ({"at_step", "steps_before", "steps_after"} each)."""

    folder: Path
    config: RunConfig
    step: int
    corpus_key: str | None = None
    extensions: tuple[dict, ...] = ()


def read_saved_run(folder: Path | str) -> SavedRun:
    """The :class:`SavedRun` of the checkpoint ``folder`` (a checkpoint without [run] read the stdlib in float32)."""
    folder = Path(folder)
    saved = checkpoint.read_config(folder)
    try:
        train = from_saved_fields(TrainConfig, saved["train"])
        config = RunConfig(saved["model"], train, from_saved_fields(RunOptions, saved.get("run", {})))
        return SavedRun(folder, config, int(saved["step"]), saved.get("corpus", {}).get("key"),
                        tuple(saved.get("extensions", ())))
    except (TypeError, ValueError, KeyError) as error:
        message = f"checkpoint: {folder}/config.json has no valid run settings: {error}"
        raise checkpoint.CheckpointError(message) from error


def run_corpus(options: RunOptions) -> data.ByteCorpus:
    """The bytes a run reads: your text (``options.data``, ``options.val``) or, by default, the stdlib's."""
    return data.text_corpus(options.data, options.val) if options.data else data.stdlib_corpus()
