"""``check(exercise_id, fn)``: grade a learner's function against the package reference.

For every case the learner's function runs first, on its own copy of the inputs; only then is the reference
computed, so no expected value exists anywhere while the learner's code runs. After the call the inputs are
compared with the originals: an answer that changes its inputs in place fails, unless the exercise allows it.

What an answer can reach: the learner's function runs on a thread of its own
(:func:`k3course.grading.fresh_stack.call_on_fresh_stack`), in a forked child for exercises that isolate, so
walking up its call stack (``frame.f_back``, ``sys._getframe``, ``inspect.stack()``) and reading the frames'
locals and globals finds neither the exercise, nor its reference, nor the registry, nor an expected value.
Out of scope, because they reach no further than ``import k3course`` does (the reference is a package
function, one import away, and reading the package is part of the course): importing the registry or the
reference, the garbage collector (``gc.get_objects``), and other threads' stacks (``sys._current_frames``).
"""

from __future__ import annotations

import copy
import inspect
import traceback
from typing import Any

import numpy as np
import torch

from k3course.grading.compare import describe, explain_difference
from k3course.grading.forbid import GRADER_DIR
from k3course.grading.fresh_stack import call_on_fresh_stack
from k3course.grading.isolation import ChildCrashed, can_isolate, run_isolated
from k3course.grading.registry import Case, Exercise, get_exercise


class _ShortTraceback:
    """In a notebook, a check's error shows its message first, then (when the learner's code raised) the
    learner's own frames, and none of the grader's: IPython displays what ``_render_traceback_`` returns."""

    def _render_traceback_(self) -> list[str]:
        lines = f"{type(self).__name__}: {self}".splitlines()
        cause = self.__cause__
        if cause is not None:
            yours = [frame for frame in traceback.extract_tb(cause.__traceback__)
                     if not frame.filename.startswith(GRADER_DIR)]
            lines += ["", "Where your function raised it (most recent call last):",
                      *(line.rstrip("\n") for line in traceback.format_list(yours)),
                      *(line.rstrip("\n") for line in traceback.format_exception_only(cause))]
        return lines


class ExerciseNotDone(_ShortTraceback, Exception):
    """Raised when the learner's function is still the stub (it raised ``NotImplementedError``)."""


class ExerciseFailed(_ShortTraceback, AssertionError):
    """Raised when the learner's function runs but disagrees with the reference on some case."""


def _first_line(error: BaseException, limit: int = 200) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _learner_call(fn, case: Case, exercise: Exercise):
    """Run ``fn`` on a copy of the case's inputs (through the exercise's harness, if any), every call of it on a
    fresh stack; its output and the inputs as it left them."""
    __tracebackhide__ = True
    args, kwargs = copy.deepcopy(case.args), copy.deepcopy(case.kwargs)

    def answer(*answer_args, **answer_kwargs):
        return call_on_fresh_stack(fn, answer_args, answer_kwargs, exercise.forbidden)

    return exercise.run(answer, args, kwargs), args, kwargs


def _same(before: Any, after: Any) -> bool:
    """Exact equality of an input before and after a call (tensors and arrays: same dtype, shape and values;
    generators: same state; modules, optimizers, schedulers: same ``state_dict()``)."""
    if isinstance(before, torch.Tensor):
        return (isinstance(after, torch.Tensor) and before.dtype == after.dtype and before.shape == after.shape
                and torch.equal(before, after))
    if isinstance(before, np.ndarray):
        return (isinstance(after, np.ndarray) and before.dtype == after.dtype and before.shape == after.shape
                and np.array_equal(before, after, equal_nan=True))
    if isinstance(before, torch.Generator):
        return isinstance(after, torch.Generator) and torch.equal(before.get_state(), after.get_state())
    if callable(getattr(before, "state_dict", None)):  # a module, an optimizer, a scheduler: its state
        return type(after) is type(before) and _same(before.state_dict(), after.state_dict())
    if isinstance(before, list | tuple):
        return (isinstance(after, list | tuple) and len(before) == len(after)
                and all(_same(b, a) for b, a in zip(before, after)))
    if isinstance(before, dict):
        return isinstance(after, dict) and before.keys() == after.keys() and all(
            _same(before[key], after[key]) for key in before)
    return before == after


def _named_inputs(exercise: Exercise, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The inputs of one call by parameter name (positions named after the reference's signature, or the
    harness's after its first parameter, the answer)."""
    if exercise.harness is None:
        names = list(inspect.signature(exercise.reference).parameters)
    else:
        names = list(inspect.signature(exercise.harness).parameters)[1:]
    named = {names[i] if i < len(names) else f"argument {i + 1}": value for i, value in enumerate(args)}
    return {**named, **kwargs}


def _changed_input(exercise: Exercise, case: Case, args: tuple, kwargs: dict) -> str | None:
    """The name of the first input the learner's call changed in place (and may not), else None."""
    after = _named_inputs(exercise, args, kwargs)
    for name, before in _named_inputs(exercise, case.args, case.kwargs).items():
        if name not in exercise.mutable and not _same(before, after[name]):
            return name
    return None


def _mutated_difference(exercise: Exercise, learner: dict, reference: dict) -> str | None:
    """For inputs the exercise updates in place: how the learner's differ from the reference's after the call."""
    for name in exercise.mutable:
        if name in reference:
            reason = explain_difference(learner[name], reference[name], exercise.tolerance,
                                        f"`{name}` after the call (it is updated in place)")
            if reason:
                return reason
    return None


def _run_learner(fn, case: Case, exercise: Exercise, where: str):
    """The learner's (output, args, kwargs) for one case; their errors become ExerciseNotDone/ExerciseFailed."""
    __tracebackhide__ = True  # IPython leaves the grader's frames out of the learner's traceback
    try:
        if exercise.isolate and can_isolate():
            return run_isolated(lambda: _learner_call(fn, case, exercise))
        return _learner_call(fn, case, exercise)
    except NotImplementedError:
        raise ExerciseNotDone(f"{exercise.id} is not done yet: replace the NotImplementedError stub "
                              "with your code") from None
    except ChildCrashed as crash:
        raise ExerciseFailed(f"{where}: {crash}") from None
    except Exception as error:  # the learner's bug, reported as a failed case
        raise ExerciseFailed(f"{where}: your function raised {type(error).__name__}: "
                             f"{_first_line(error)}") from error


def _grade_case(fn, case: Case, exercise: Exercise, n_cases: int) -> Exception | None:
    """Run one case: the learner first, then the inputs, then the reference; the first problem, or None."""
    where = f"{exercise.id}, case '{case.name}'"
    try:
        got, args, kwargs = _run_learner(fn, case, exercise, where)
    except (ExerciseNotDone, ExerciseFailed) as failure:
        return failure
    changed = _changed_input(exercise, case, args, kwargs)
    if changed is not None:
        return ExerciseFailed(f"{where}: your function changed its input `{changed}` in place\n"
                              "  leave inputs unchanged: compute new tensors (x * a, x.clone()) instead of "
                              "in-place ops (x.mul_(a), x[...] = ..., x += ...)")
    reference_args, reference_kwargs = copy.deepcopy(case.args), copy.deepcopy(case.kwargs)
    want = exercise.run(exercise.reference, reference_args, reference_kwargs)
    reason = explain_difference(got, want, exercise.tolerance) or _mutated_difference(
        exercise, _named_inputs(exercise, args, kwargs), _named_inputs(exercise, reference_args, reference_kwargs))
    return ExerciseFailed(f"{where} ({n_cases} cases in all):\n{reason}") if reason else None


def check(exercise_id: str, fn) -> None:
    """Run ``fn`` on every seeded case of ``exercise_id`` and compare it with the reference.

    Success prints one deterministic line. A stub raises :class:`ExerciseNotDone`; a wrong answer raises
    :class:`ExerciseFailed` whose message (at most three lines) names the case and what differs, never the
    expected values.
    """
    __tracebackhide__ = True
    exercise = get_exercise(exercise_id)
    if not callable(fn):
        raise TypeError(f"fn must be the function you wrote for {exercise_id}, got {describe(fn)}")
    cases = exercise.cases()
    for case in cases:
        failure = _grade_case(fn, case, exercise, len(cases))
        if failure is not None:  # raised from here: your traceback shows your code, not the grader's
            raise failure.with_traceback(None)
    print(f"{exercise_id}: passed all {len(cases)} cases")
