"""The NumPy rung of every component chapter: one NumPy exercise each in chapters 01–07, 09 and 10, whose solutions
import no torch, graded with torch refused; and the NumPy references they are graded against agree with the torch
rung on the exercises' own cases."""

from __future__ import annotations

import copy

import nbformat
import numpy as np
import pytest
import torch
from helpers import ROOT

from k3course.grading import ExerciseFailed, all_exercises, check, get_exercise
from k3course.grading.registry import NUMPY_ONLY
from k3course.ops import gdn_recurrent, gla_recurrent, kda_chunk, kda_recurrent

COMPONENT_CHAPTERS = ("01", "02", "03", "04", "05", "06", "07", "09", "10")


def numpy_exercises() -> dict[str, list[str]]:
    """Chapter -> the ids of its NumPy exercises (those that refuse every torch call)."""
    by_chapter: dict[str, list[str]] = {}
    for exercise_id, exercise in all_exercises().items():
        if exercise.forbidden is not None and exercise.forbidden.every_call:
            by_chapter.setdefault(exercise_id[:2], []).append(exercise_id)
    return by_chapter


def defining_cell(exercise_id: str) -> str:
    """The source of the solution cell that defines the function of ``exercise_id``."""
    name = exercise_id.split(".", 1)[1]
    for path in sorted((ROOT / "solutions").glob(f"{exercise_id[:2]}_*.ipynb")):
        for cell in nbformat.read(path, 4).cells:
            if cell.cell_type == "code" and f"def {name}(" in cell.source:
                return cell.source
    raise AssertionError(f"no solution cell defines {name}")


def test_every_component_chapter_has_a_numpy_exercise():
    by_chapter = numpy_exercises()
    missing = [chapter for chapter in COMPONENT_CHAPTERS if not by_chapter.get(chapter)]
    assert not missing, f"chapters without a NumPy exercise: {missing}"


@pytest.mark.parametrize("exercise_id", sorted(i for ids in numpy_exercises().values() for i in ids))
def test_a_numpy_solution_imports_no_torch_and_is_refused_in_torch(exercise_id):
    source = defining_cell(exercise_id)
    assert "torch" not in source and "import numpy" in source, source[:200]
    reference = get_exercise(exercise_id).reference

    def through_torch(*args, **kwargs):  # the right answer, with one torch call on the way
        torch.zeros(1).add(1)
        return reference(*args, **kwargs)

    with pytest.raises(ExerciseFailed, match="NumPy rung"):
        check(exercise_id, through_torch)


def test_numpy_only_refuses_tensor_methods_and_conversions():
    from k3course.grading.forbid import ForbiddenCall, refusing

    tensor = torch.ones(2)
    with refusing(NUMPY_ONLY), pytest.raises(ForbiddenCall, match="called as_tensor"):
        torch.as_tensor(np.ones(2))
    with refusing(NUMPY_ONLY), pytest.raises(ForbiddenCall, match="called numpy"):
        tensor.numpy()
    with refusing(NUMPY_ONLY):
        np.ones(2).sum()  # NumPy itself runs


def _as_torch(value):
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


# the torch rung of each linear-attention exercise, called on its inputs (float64 tensors)
TORCH_RUNGS = {
    "04.decay_recurrence_numpy": lambda q, k, v, g, scale=None, initial_state=None: gla_recurrent(
        q, k, v, g, scale, initial_state, output_final_state=True),
    "05.gated_delta_numpy": lambda q, k, v, g, beta, scale=None, initial_state=None: gdn_recurrent(
        q, k, v, g, beta, scale, initial_state, output_final_state=True),
    "06.kda_numpy": lambda q, k, v, g, beta, scale=None, initial_state=None: kda_recurrent(
        q, k, v, g, beta, scale, initial_state, output_final_state=True),
    "07.kda_chunkwise_numpy": lambda q, k, v, g, beta, chunk_size, initial_state=None: kda_chunk(
        q, k, v, g, beta, None, initial_state, output_final_state=True, chunk_size=chunk_size),
}


@pytest.mark.parametrize("exercise_id", sorted(TORCH_RUNGS))
def test_the_numpy_reference_agrees_with_the_torch_rung(exercise_id):
    exercise = get_exercise(exercise_id)
    for case in exercise.cases():
        want = exercise.reference(*copy.deepcopy(case.args), **copy.deepcopy(case.kwargs))
        args = tuple(_as_torch(a) for a in case.args)
        kwargs = {key: _as_torch(value) for key, value in case.kwargs.items()}
        got = TORCH_RUNGS[exercise_id](*args, **kwargs)
        for g, w in zip(got, want):  # the torch rung runs in float32
            np.testing.assert_allclose(g.double().numpy(), w, rtol=1e-4, atol=1e-5, err_msg=case.name)
