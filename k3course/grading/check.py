"""``check(exercise_id, fn)``: grade a learner's function against the package reference."""

from __future__ import annotations

import copy
from typing import Any

from k3course.grading.compare import explain_difference
from k3course.grading.registry import get_exercise


class ExerciseNotDone(Exception):
    """Raised when the learner's function is still the stub (it raised ``NotImplementedError``)."""


class ExerciseFailed(AssertionError):
    """Raised when the learner's function runs but disagrees with the reference on some case."""


def _call(fn, case) -> Any:
    return fn(*copy.deepcopy(case.args), **copy.deepcopy(case.kwargs))


def check(exercise_id: str, fn) -> None:
    """Run ``fn`` on every seeded case of ``exercise_id`` and compare it with the reference.

    Success prints one deterministic line. A stub raises :class:`ExerciseNotDone`; a wrong answer raises
    :class:`ExerciseFailed` whose message names the case and what differs, never the expected values.
    """
    exercise = get_exercise(exercise_id)
    if not callable(fn):
        raise TypeError(f"fn must be the function you wrote for {exercise_id}, got {type(fn).__name__}")
    cases = exercise.cases()
    for case in cases:
        want = _call(exercise.reference, case)
        try:
            got = _call(fn, case)
        except NotImplementedError:
            raise ExerciseNotDone(f"{exercise_id} is not done yet: replace the NotImplementedError stub "
                                  "with your code") from None
        except Exception as error:  # the learner's bug, reported as a failed case
            raise ExerciseFailed(f"{exercise_id}, case '{case.name}': your function raised "
                                 f"{type(error).__name__}: {error}") from error
        if exercise.normalize is not None:
            got, want = exercise.normalize(got), exercise.normalize(want)
        reason = explain_difference(got, want, exercise.tolerance)
        if reason:
            raise ExerciseFailed(f"{exercise_id}, case '{case.name}' ({len(cases)} cases in all):\n{reason}")
    print(f"{exercise_id}: passed all {len(cases)} cases")
