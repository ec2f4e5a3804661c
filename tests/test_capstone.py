"""The capstone reads your functions from your saved exercise notebooks (a stub falls back to the solved notebook),
fits chapter 10's signature to the model's call, and trains with them; a wrong part shows in the losses."""

from __future__ import annotations

import nbformat
import numpy as np
import pytest
import torch
from helpers import ROOT

from k3course.lessons import capstone
from k3course.moe.routing import topk_route


def exercise_notebook(path, body: str) -> None:
    """A notebook like chapter 01's exercises: an import cell, the function's cell, a check cell."""
    cells = [nbformat.v4.new_code_cell("import torch\n\nfrom k3course.grading import check"),
             nbformat.v4.new_code_cell(body), nbformat.v4.new_code_cell('check("01.topk_route", topk_route)')]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)


def test_your_function_comes_from_your_notebook_and_a_stub_from_the_solutions(tmp_path):
    (tmp_path / "solutions").symlink_to(ROOT / "solutions")
    exercise_notebook(tmp_path / "exercises" / capstone.PART_NOTEBOOKS["topk_route"],
                      "def topk_route(scores, k, bias=None, renormalize=True):\n    return 'mine'\n")
    exercise_notebook(tmp_path / "exercises" / capstone.PART_NOTEBOOKS["kda_step"],
                      "def kda_step(state, q, k, v, g, beta):\n    raise NotImplementedError('06.kda_step')\n")
    parts = {part.name: part for part in capstone.your_parts(tmp_path)}
    assert set(parts) == set(capstone.PART_NOTEBOOKS)
    assert parts["topk_route"].function(None, 1) == "mine"
    assert str(parts["topk_route"].notebook).startswith("exercises")
    assert str(parts["kda_step"].notebook).startswith("solutions")


def test_chapter_10s_depth_attention_takes_the_models_eps_and_refuses_another():
    (part,) = [p for p in capstone.your_parts(ROOT) if p.name == "depth_attention"]
    sources = torch.randn(3, 1, 2, 8)
    h, weights = part.function(torch.randn(8), sources, capstone.EXERCISE_EPS)
    assert h.shape == (1, 2, 8) and torch.allclose(weights.sum(0), torch.ones(1, 2))
    with pytest.raises(ValueError, match="eps"):
        part.function(torch.randn(8), sources, 1e-5)


def test_training_with_a_wrong_part_departs_and_with_a_right_one_does_not():
    tokens = np.frombuffer(b"def f(x):\n    return x + 1\n" * 40, dtype=np.uint8)
    cfg = capstone.capstone_config()
    run = dict(steps=2, batch_size=1, seq_len=32)
    _, package = capstone.train_briefly(cfg, tokens, **run)
    _, same = capstone.train_briefly(cfg, tokens, **run, parts={"topk_route": topk_route})
    lowest = lambda scores, k, bias=None, renormalize=True: topk_route(-scores, k, bias, renormalize)
    _, wrong = capstone.train_briefly(cfg, tokens, **run, parts={"topk_route": lowest})
    assert same == package and wrong[0] != package[0]
