"""The grading contract on the registry: references pass, stubs are 'not done', wrong answers fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import notebooks, wrong_answers

from k3course.grading import Case, Exercise, ExerciseFailed, ExerciseNotDone, all_exercises, check, get_exercise
from k3course.grading.compare import explain_difference
from k3course.grading.notebooks import check_ids
from k3course.grading.registry import _EXERCISES

EXERCISES = sorted(all_exercises())
WRONG = wrong_answers()


@pytest.mark.parametrize("exercise_id", EXERCISES)
def test_reference_passes_its_own_check(exercise_id, capsys):
    check(exercise_id, get_exercise(exercise_id).reference)
    assert capsys.readouterr().out.strip().startswith(f"{exercise_id}: passed all")


@pytest.mark.parametrize("exercise_id", EXERCISES)
def test_stub_is_not_done(exercise_id):
    def stub(*args, **kwargs):
        raise NotImplementedError("exercise: replace this line with your code")

    with pytest.raises(ExerciseNotDone, match=exercise_id):
        check(exercise_id, stub)


@pytest.mark.parametrize("exercise_id", EXERCISES)
def test_wrong_answers_are_rejected(exercise_id):
    assert WRONG.get(exercise_id), f"tests/wrong/ has no plausible wrong answer for {exercise_id}"
    for wrong in WRONG[exercise_id]:
        with pytest.raises(ExerciseFailed) as failure:
            check(exercise_id, wrong)
        assert len(str(failure.value).splitlines()) <= 3, str(failure.value)


def test_every_exercise_is_in_a_notebook_and_every_check_is_registered():
    used = {eid for path in notebooks("exercises") for cell in __import__("nbformat").read(path, 4).cells
            if cell.cell_type == "code" for eid in check_ids(cell.source)}
    assert used <= set(EXERCISES), f"checks of unregistered exercises: {sorted(used - set(EXERCISES))}"
    assert set(EXERCISES) <= used, f"registered but in no exercise notebook: {sorted(set(EXERCISES) - used)}"


# --- the comparison and messages, on a synthetic exercise -------------------------------------------------

@pytest.fixture
def toy_exercise():
    def reference(x):
        return x.cumsum(0) * 7.25

    exercise = Exercise("99.toy_cumsum", reference, lambda: [Case("seeded", (torch.arange(6.0),))])
    _EXERCISES[exercise.id] = exercise
    yield exercise.id
    del _EXERCISES[exercise.id]


def test_failure_names_case_and_index_but_not_expected_values(toy_exercise):
    with pytest.raises(ExerciseFailed) as failure:
        check(toy_exercise, lambda x: x.cumsum(0) * 7.0)
    message = str(failure.value)
    assert "case 'seeded'" in message and "first bad index (1,)" in message
    assert "7.25" not in message and "108.75" not in message  # reference values stay hidden
    assert len(message.splitlines()) == 3


def test_shape_and_dtype_and_type_mismatches_are_named(toy_exercise):
    with pytest.raises(ExerciseFailed, match=r"shape \(5,\) but expected shape \(6,\)"):
        check(toy_exercise, lambda x: x[:5])
    with pytest.raises(ExerciseFailed, match="dtype float64 but expected dtype float32"):
        check(toy_exercise, lambda x: (x.cumsum(0) * 7.25).double())
    with pytest.raises(ExerciseFailed, match="expected a Tensor, got a ndarray"):
        check(toy_exercise, lambda x: x.numpy().cumsum() * 7.25)
    with pytest.raises(ExerciseFailed, match="raised ZeroDivisionError"):
        check(toy_exercise, lambda x: 1 / 0)


def test_nan_is_reported():
    assert "NaN" in explain_difference(np.array([1.0, np.nan]), np.array([1.0, 2.0]))


def test_structures_and_integers():
    assert explain_difference((torch.tensor([1, 2]), 3.0), (torch.tensor([1, 2]), 3.0)) is None
    assert "1 of 2 entries differ" in explain_difference(torch.tensor([1, 3]), torch.tensor([1, 2]))
    assert "of 2 items" in explain_difference((1.0,), (1.0, 2.0))
    assert "keys" in explain_difference({"a": 1}, {"b": 1})


def test_unknown_exercise_lists_known_ones():
    with pytest.raises(KeyError, match="exercise_id 'nope' is not a registered exercise"):
        check("nope", lambda: None)
