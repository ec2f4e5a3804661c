"""The configuration a command line trains: ``k3course train`` (one process or ``--ep P`` spawned ranks) and one
torchrun rank (``python -m k3course.train``) both resolve theirs here (:func:`configure`) and hand it to the
door, :func:`k3course.train.train`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from k3course import checkpoint
from k3course.train.config import RunConfig, SavedRun, read_saved_run, resolve_config


def configure(preset_name: str | None = None, out: Path | str | None = None, config_file: Path | str | None = None,
              flags: Sequence[tuple[str, str, object]] = (), sets: Sequence[str] = (), resume: bool = False,
              extend_to: int | None = None) -> tuple[RunConfig, Path, bool | str, SavedRun | None]:
    """What ``k3course train`` runs: (the configuration :func:`resolve_config` makes, its folder (default
    ``runs/PRESET``), the door's ``resume`` (False, True or "extend"), the run it continues (None for a fresh
    run)). With ``resume`` or ``extend_to`` the run's saved configuration is the base unless a preset is named;
    ``extend_to`` N sets ``train.steps`` = N."""
    out = Path(out) if out is not None else Path("runs") / (preset_name or "tiny")
    if resume and extend_to is not None:
        raise ValueError("--extend-to: --resume continues a run as it was and --extend-to gives it more steps; "
                         "use one")
    if extend_to is not None and any(key == "train.steps" for _, key, _ in flags):
        raise ValueError(f"--steps: with --extend-to {extend_to} the run's new total is {extend_to}; leave out --steps")
    saved = None
    if resume or extend_to is not None:
        latest = checkpoint.latest_checkpoint(out)
        if latest is None:
            raise FileNotFoundError(f"out: no checkpoint to resume in {out}")
        saved = read_saved_run(latest)
    if extend_to is not None:
        flags = [*flags, ("--extend-to", "train.steps", extend_to)]
    config = resolve_config(preset_name, config_file, flags, sets, saved.config if saved else None)
    return config, out, "extend" if extend_to is not None else resume, saved
