"""Run folders: checkpoints, one folder per optimizer step, written under a temporary name and renamed when
complete, and the run's metrics.jsonl (:class:`MetricsLog`, :func:`read_metrics`).

    out/metrics.jsonl       one JSON object per optimizer step: {"step", "loss", "lr", ..., "val_bpb" when evaluated}
    out/step-000600/
        model.safetensors   the weights and buffers (MoE balancing biases included), by name
        config.json         {"model": K3Config fields, "train": TrainConfig fields, ..., "step": 600}: the one
                            place the step is stored
        state.pt            optimizer and scheduler state, torch RNG state

A folder named ``step-*`` is complete by construction (the rename is the last thing that happens), so a crash
while saving leaves a ``.tmp-*`` folder that is ignored, never a half-written checkpoint under a good name.
Anything that cannot be read back, or does not fit the model it is loaded into, raises
:class:`CheckpointError` naming the folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import safetensors.torch
import torch

from k3course.config import K3Config

STEP_DIR = re.compile(r"^step-(\d{6,})$")
WEIGHTS = ("model.safetensors", "config.json")  # what loading a model needs (a shipped model holds only these)
FILES = (*WEIGHTS, "state.pt")  # what resuming a run needs


class CheckpointError(RuntimeError):
    """A checkpoint folder that is missing, incomplete, corrupt, or made for another model."""


def step_dir(out: Path, step: int) -> Path:
    """``out/step-NNNNNN``: the folder of the checkpoint taken after ``step`` optimizer steps."""
    return Path(out) / f"step-{step:06d}"


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``out`` as (step, folder), oldest first (temporary folders are skipped)."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in out.iterdir() if (m := STEP_DIR.match(path.name)) and path.is_dir()]
    return sorted(found)


def latest_checkpoint(out: Path) -> Path | None:
    """The folder of the highest step in ``out``, or None when there is none."""
    found = checkpoints(out)
    return found[-1][1] if found else None


def find_checkpoint(path: Path | str) -> Path:
    """``path`` itself when it is a checkpoint folder, else the latest checkpoint of the run folder ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: no folder at {path}")
    folder = path if (path / "config.json").exists() else latest_checkpoint(path)
    if folder is None:
        raise CheckpointError(f"checkpoint: {path} holds no checkpoint (step-NNNNNN folders)")
    return folder


def save_checkpoint(out: Path, step: int, model: torch.nn.Module, optimizer, scheduler, config: dict) -> Path:
    """Write the checkpoint of ``step`` into ``out`` atomically; returns its folder.

    ``config`` is JSON-serialisable ({"model": ..., "train": ...}); the step is added to it. An existing
    checkpoint of the same step is replaced only once the new one is completely written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    final = step_dir(out, step)
    temporary = Path(tempfile.mkdtemp(dir=out, prefix=f".tmp-{final.name}-"))
    try:
        safetensors.torch.save_model(model, str(temporary / "model.safetensors"))
        (temporary / "config.json").write_text(json.dumps({**config, "step": step}, indent=1))
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "rng": {"torch": torch.get_rng_state()}}
        if torch.cuda.is_available():
            state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(state, temporary / "state.pt")
        _swap_in(temporary, final)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return final


def _swap_in(temporary: Path, final: Path) -> None:
    """Rename ``temporary`` to ``final``; an old ``final`` is moved aside first and deleted after."""
    if not final.exists():
        os.rename(temporary, final)
        return
    aside = final.with_name(f".old-{final.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(final, aside)
    os.rename(temporary, final)
    shutil.rmtree(aside, ignore_errors=True)


def read_config(folder: Path) -> dict:
    """The checkpoint's config.json, with ``model`` turned back into a :class:`K3Config`."""
    folder = _require_complete(Path(folder), ("config.json",))
    try:
        config = json.loads((folder / "config.json").read_text())
        config["model"] = K3Config.from_dict(config["model"])  # fields added since it was saved: defaults
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint: {folder}/config.json is unreadable or not a K3 config: {error}") from error
    return config


def load_weights(folder: Path, model: torch.nn.Module) -> None:
    """Load model.safetensors into ``model`` (strict: every name and shape must match); the folder needs no
    state.pt (a model shipped for generation holds only its weights and config). A sharded checkpoint (DCP's
    pieces, :mod:`k3course.distributed.sharded_checkpoint`) is read in this process into the plain model."""
    if (Path(folder) / ".metadata").is_file():
        _load_sharded_weights(Path(folder), model)
        return
    folder = _require_complete(Path(folder), WEIGHTS)
    try:
        missing, unexpected = safetensors.torch.load_model(model, str(folder / "model.safetensors"), strict=False,
                                                           device=str(next(model.parameters()).device))
    except (RuntimeError, OSError, safetensors.SafetensorError) as error:
        raise CheckpointError(f"checkpoint: {folder}/model.safetensors does not fit this model: {error}") from error
    if missing or unexpected:
        raise CheckpointError(f"checkpoint: {folder} was saved from another model: missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)}")


def _load_sharded_weights(folder: Path, model: torch.nn.Module) -> None:
    """The weights and persistent buffers of a sharded checkpoint ("model.NAME" in DCP's files) into ``model``,
    in place, without a process group (every piece is read; nothing else of the run is)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, checkpoint_id=folder, no_dist=True)
    except (RuntimeError, OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"checkpoint: {folder} (sharded) does not fit this model: {error}") from error


def load_state(folder: Path, optimizer, scheduler) -> None:
    """Restore optimizer, scheduler and RNG state from state.pt (the step to continue from is config.json's)."""
    folder = _require_complete(Path(folder))
    try:
        state = torch.load(folder / "state.pt", weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (RuntimeError, OSError, KeyError, ValueError) as error:
        raise CheckpointError(f"checkpoint: {folder}/state.pt is corrupt or from another optimizer: {error}") from error
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


def _require_complete(folder: Path, files: tuple[str, ...] = FILES) -> Path:
    """``folder`` if it holds every one of ``files``, else CheckpointError naming the missing ones."""
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint: {folder} is not a checkpoint folder (missing {', '.join(missing)})")
    return folder


class MetricsLog:
    """Writes ``out``/metrics.jsonl, one JSON object per line. Opening it keeps the records of steps ≤
    ``keep_until`` (a resumed run drops those after its checkpoint; 0: a fresh file)."""

    def __init__(self, out: Path | str, keep_until: int = 0):
        self.path = Path(out) / "metrics.jsonl"
        kept = [r for r in read_metrics(out) if r["step"] <= keep_until] if keep_until else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        """Append ``record`` as one line."""
        with self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")


def read_metrics(out: Path | str) -> list[dict]:
    """The records of ``out``/metrics.jsonl, in order ([] when there is no such file)."""
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
