"""The capstone (lesson 16): your own chapter functions, taken from your exercise notebooks, inside the model.

:func:`your_parts` reads the function you wrote for each swappable part (:data:`k3course.lessons.parts.PARTS`)
from your saved exercise notebook — the cell that defines it, run after the notebook's import cell — and falls
back to the solved notebook in ``solutions/`` where your exercise is still a stub. :func:`train_briefly` trains
the same seeded tiny K3 on the same bytes with the package's parts or with yours, so the two loss curves can be
laid on each other.

    part              chapter    the model calls it
    topk_route        01         in every MoE layer: top-k on s + b, weights from s
    kda_step          06         in the recurrent KDA path (decoding, inputs of up to one chunk)
    ut_transform      07         in the chunked KDA path (training; prefill longer than a chunk)
    depth_attention   10         in every Block AttnRes read
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nbformat
import torch

from k3course import train
from k3course.config import K3Config
from k3course.lessons.parts import use_parts

# part -> the exercise notebook (in exercises/ and solutions/) whose function it is
PART_NOTEBOOKS: dict[str, str] = {
    "topk_route": "01_sparse_moe_exercises.ipynb",
    "kda_step": "06_kda_exercises.ipynb",
    "ut_transform": "07_chunkwise_exercises.ipynb",
    "depth_attention": "10_residuals_exercises.ipynb",
}
STUB = "raise NotImplementedError"
EXERCISE_EPS = 1e-6  # the RMSNorm ε chapter 10's depth_attention exercise writes into its function


@dataclass(frozen=True)
class Part:
    """One of your functions: its ``name``, the function, and the notebook it came from."""

    name: str
    function: Callable
    notebook: Path


def _defining_cell(notebook: nbformat.NotebookNode, name: str) -> str | None:
    """The source of the code cell that defines ``def name(``, or None."""
    pattern = re.compile(rf"^def {name}\(", re.M)
    return next((cell.source for cell in notebook.cells if cell.cell_type == "code" and pattern.search(cell.source)),
                None)


def _first_code_cell(notebook: nbformat.NotebookNode) -> str:
    return next(cell.source for cell in notebook.cells if cell.cell_type == "code")


def function_from_notebook(path: Path | str, name: str) -> Callable | None:
    """The function ``name`` as the notebook at ``path`` defines it: its import cell, then its defining cell, run
    in a namespace of their own. None when no cell defines it or the definition is still the stub."""
    path = Path(path)
    if not path.is_file():
        return None
    notebook = nbformat.read(path, 4)
    source = _defining_cell(notebook, name)
    if source is None or STUB in source:
        return None
    namespace: dict = {"__name__": f"notebook_{path.stem}"}
    exec(compile(_first_code_cell(notebook), str(path), "exec"), namespace)
    exec(compile(source, str(path), "exec"), namespace)
    return fitted(name, namespace[name])


def fitted(name: str, function: Callable) -> Callable:
    """``function`` callable the way the model calls the part. The model calls ``depth_attention(query, sources,
    eps)``; chapter 10's exercise takes ``(query, sources)`` with its ε = 1e-6 written in, so it is wrapped to
    accept that ε (and refuse another, which it would silently ignore)."""
    if name != "depth_attention" or "eps" in inspect.signature(function).parameters:
        return function

    def depth_attention(query, sources, eps=EXERCISE_EPS):
        if eps != EXERCISE_EPS:
            raise ValueError(f"eps: your depth_attention uses ε = {EXERCISE_EPS}; the model asks for {eps}")
        return function(query, sources)

    return depth_attention


def your_parts(root: Path | str = "..", folder: str = "exercises") -> list[Part]:
    """Your function for each part of :data:`PART_NOTEBOOKS`, from ``root/folder`` (your saved exercise
    notebooks), else from ``root/solutions`` where yours is not written yet."""
    root = Path(root)
    parts = []
    for name, notebook in PART_NOTEBOOKS.items():
        for where in (root / folder / notebook, root / "solutions" / notebook):
            function = function_from_notebook(where, name)
            if function is not None:
                parts.append(Part(name, function, where.relative_to(root)))
                break
        else:
            raise FileNotFoundError(f"root: no notebook under {root} defines {name} ({notebook})")
    return parts


def capstone_config() -> K3Config:
    """The tiny K3 with 128-byte windows, so the chunked KDA path (two chunks of 64) runs ``ut_transform``."""
    return K3Config.preset("tiny")


def train_briefly(cfg: K3Config, tokens, steps: int = 30, batch_size: int = 4, seq_len: int = 128, seed: int = 0,
                  parts: dict[str, Callable] | None = None) -> tuple[torch.nn.Module, list[float]]:
    """``steps`` AdamW steps of the seeded model on windows of ``tokens`` (the same batches for every call), with
    ``parts`` (see :func:`~k3course.lessons.parts.use_parts`) in place of the package's. Returns (model, the loss
    of each step)."""
    config = train.TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, warmup_steps=min(5, steps),
                               seed=seed)
    stepper = train.Stepper(cfg, config, train.text_batches(tokens, config))
    with use_parts(**(parts or {})):
        losses = [stepper()["loss"] for _ in range(steps)]
    return stepper.model, losses
