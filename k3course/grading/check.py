"""``check(exercise_id, fn)``: grade a learner's function against the package reference.

For every case the learner's function runs first, on its own copy of the inputs; only then is the reference
computed, so no expected value exists anywhere while the learner's code runs. After the call the inputs are
compared with the originals: an answer that changes its inputs in place fails, unless the exercise allows it.

What an answer can reach: the learner's function runs on a thread of its own
(:func:`k3course.grading.fresh_stack.call_on_fresh_stack`), in a forked child for exercises that isolate, so
walking up its call stack (``frame.f_back``, ``sys._getframe``, ``inspect.stack()``) and reading the frames'
locals and globals finds neither the exercise, nor its reference, nor the registry, nor an expected value.
Calling the reference, or another package function that answers the exercise, is refused however it is reached
(:mod:`k3course.grading.package_answer`). Out of scope, because they reach no further than ``import k3course``
does (reading the package is part of the course): importing the registry to read expected values, the garbage
collector (``gc.get_objects``), other threads' stacks (``sys._current_frames``), and switching the refusal's
profile hook off (``sys.setprofile``).

Then, for an exercise in the training path, the backward cases (gradients against the reference's); and when a
case fails, a multi-step exercise's probes name the step (see :mod:`k3course.grading`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from k3course.grading.compare import describe, explain_difference
from k3course.grading.forbid import GRADER_DIR
from k3course.grading.fresh_stack import call_on_fresh_stack
from k3course.grading.gradients import NoGradient, finite_differences, gradients, leaves
from k3course.grading.guard_bands import GuardBands, OutsideWrite
from k3course.grading.isolation import ChildCrashed, can_isolate, run_isolated
from k3course.grading.package_answer import PackageAnswer, PackageRule, package_rule
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


def _learner_call(fn, case: Case, exercise: Exercise, package: PackageRule | None):
    """Run ``fn`` on a copy of the case's inputs (through the exercise's harness, if any), every call of it on a
    fresh stack; its output and the inputs as it left them. With guard bands, the inputs and what the answer
    allocates sit inside them, checked after the call (:class:`OutsideWrite`)."""
    __tracebackhide__ = True
    args, kwargs = copy.deepcopy(case.args), copy.deepcopy(case.kwargs)
    bands = GuardBands() if exercise.guard_bands else None
    if bands is not None:
        args, kwargs = bands.inputs(args, kwargs, _parameter_names(exercise.reference))

    def answer(*answer_args, **answer_kwargs):
        return call_on_fresh_stack(fn, answer_args, answer_kwargs, exercise.forbidden, package, bands)

    got = exercise.run(answer, args, kwargs)
    if bands is not None:
        bands.check()
    return got, args, kwargs


def _same(before: Any, after: Any) -> bool:
    """Exact equality of an input before and after a call (tensors and arrays: same dtype, shape and values;
    generators: same state; modules, optimizers, schedulers: same ``state_dict()``; a float NaN stays NaN)."""
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
    if isinstance(before, float) and math.isnan(before):  # NaN is itself though it compares unequal
        return isinstance(after, float) and math.isnan(after)
    return before == after


def _parameter_names(function: Callable) -> list[str]:
    """``function``'s parameter names; none for a built-in without a signature (``torch.square``): its inputs are
    then named by position."""
    try:
        return list(inspect.signature(function).parameters)
    except ValueError:
        return []


def _named_inputs(exercise: Exercise, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The inputs of one call by parameter name (positions named after the reference's signature, or the
    harness's after its first parameter, the answer)."""
    names = _parameter_names(exercise.reference) if exercise.harness is None else _parameter_names(exercise.harness)[1:]
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


def _run_learner(call, exercise: Exercise, where: str):
    """``call()`` (the learner's part of one case); its errors become ExerciseNotDone/ExerciseFailed."""
    __tracebackhide__ = True  # IPython leaves the grader's frames out of the learner's traceback
    try:
        if exercise.isolate and can_isolate():
            return run_isolated(call)
        return call()
    except NotImplementedError:
        raise ExerciseNotDone(f"{exercise.id} is not done yet: replace the NotImplementedError stub "
                              "with your code") from None
    except (ChildCrashed, PackageAnswer, NoGradient, OutsideWrite) as failure:
        raise ExerciseFailed(f"{where}: {failure}") from None
    except Exception as error:  # the learner's bug, reported as a failed case
        raise ExerciseFailed(f"{where}: your function raised {type(error).__name__}: "
                             f"{_first_line(error)}") from error


def _compare_case(fn, case: Case, exercise: Exercise, package: PackageRule | None, where: str) -> str | None:
    """Run one case: the learner first, then the inputs, then the reference; why the learner's answer differs
    (≤ 2 lines), or None. A learner's error is raised (ExerciseNotDone / ExerciseFailed)."""
    __tracebackhide__ = True
    got, args, kwargs = _run_learner(lambda: _learner_call(fn, case, exercise, package), exercise, where)
    changed = _changed_input(exercise, case, args, kwargs)
    if changed is not None:
        raise ExerciseFailed(f"{where}: your function changed its input `{changed}` in place\n"
                             "  leave inputs unchanged: compute new tensors (x * a, x.clone()) instead of "
                             "in-place ops (x.mul_(a), x[...] = ..., x += ...)")
    reference_args, reference_kwargs = copy.deepcopy(case.args), copy.deepcopy(case.kwargs)
    want = exercise.run(exercise.reference, reference_args, reference_kwargs)
    return explain_difference(got, want, exercise.tolerance) or _mutated_difference(
        exercise, _named_inputs(exercise, args, kwargs), _named_inputs(exercise, reference_args, reference_kwargs))


def _diagnosis(fn, exercise: Exercise, package: PackageRule | None) -> str | None:
    """The exercise's diagnostic variants run in order, simplest first; the first that fails names its step:
    "correct with B (and 1 simpler variant); wrong with C: <where to look>". None when there are none, or when
    all pass."""
    if exercise.probes is None:
        return None
    passed = []
    for probe in exercise.probes():
        try:
            reason = _compare_case(fn, probe.case, exercise, package, probe.label)
        except (ExerciseFailed, ExerciseNotDone):
            reason = "raised"
        if reason is None:
            passed.append(probe.label)
            continue
        if not passed:
            return f"wrong already {probe.label}: {probe.hint}"
        more = len(passed) - 1
        simpler = f" (and {more} simpler variant{'s' if more > 1 else ''})" if more else ""
        return f"correct {passed[-1]}{simpler}; wrong {probe.label}: {probe.hint}"
    return None


def _grade_case(fn, case: Case, exercise: Exercise, package: PackageRule | None, n_cases: int) -> Exception | None:
    """One case graded; the failure to raise (its message names the step when the exercise has probes), or None."""
    where = f"{exercise.id}, case '{case.name}'"
    try:
        reason = _compare_case(fn, case, exercise, package, where)
    except (ExerciseNotDone, ExerciseFailed) as failure:
        return failure
    if reason is None:
        return None
    diagnosis = _diagnosis(fn, exercise, package)
    if diagnosis is not None:
        return ExerciseFailed(f"{where} ({n_cases} cases in all):\n{reason.splitlines()[0]}\n  {diagnosis}")
    return ExerciseFailed(f"{where} ({n_cases} cases in all):\n{reason}")


def _backward_cases(exercise: Exercise) -> list[Case]:
    """The exercise's backward cases: its own where no differentiated input is a tensor of another dtype than
    float32/float64, unless the exercise builds others."""
    if exercise.backward.cases is not None:
        return exercise.backward.cases()
    wrt = exercise.backward.wrt

    def low_precision(value) -> bool:
        if isinstance(value, list | tuple):
            return any(low_precision(item) for item in value)
        return isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16)

    return [case for case in exercise.cases()
            if not any(low_precision(value) for name, value in _named_inputs(exercise, case.args, case.kwargs).items()
                       if wrt is None or name in wrt)]


def _with_leaves(exercise: Exercise, case: Case, inputs: dict | None = None):
    """(args, kwargs, leaves): a copy of the case's inputs whose differentiated ones are fresh leaves (``inputs``:
    replacements of the leaves by name, for finite differences)."""
    args, kwargs = copy.deepcopy(case.args), copy.deepcopy(case.kwargs)
    named = _named_inputs(exercise, args, kwargs)
    replacements, found = leaves(named, exercise.backward.wrt)
    if inputs is not None:
        replacements = {name: inputs.get(name, value) for name, value in replacements.items()}
    names = list(named)
    args = tuple(replacements.get(names[i], value) for i, value in enumerate(args))
    kwargs = {key: replacements.get(key, value) for key, value in kwargs.items()}
    return args, kwargs, found


def _reference_gradients(exercise: Exercise, case: Case) -> dict:
    """The reference's gradients on a backward case: autograd through it, or float64 finite differences."""
    args, kwargs, wrt = _with_leaves(exercise, case)
    if not exercise.backward.finite_differences:
        return gradients(exercise.reference, args, kwargs, wrt, exercise.backward.outputs)

    def call(inputs):
        nudged_args, nudged_kwargs, _ = _with_leaves(exercise, case, inputs)
        return exercise.reference(*nudged_args, **nudged_kwargs)

    return finite_differences(call, wrt, exercise.backward.outputs)


NAN_HINT = ("  the forward is right: an exp(·) that overflows where you mask or select it away still sends "
            "inf · 0 = NaN back; clamp the exponent before exp (masking after, or torch.where, is too late)")


def _gradient_difference(mine, want, name: str, tolerance: dict) -> str | None:
    """How the learner's gradient with respect to ``name`` differs from the reference's (≤ 2 lines), or None."""
    if mine is None or want is None:
        if mine is None and want is None:
            return None
        return (f"your gradient with respect to {name} is missing: your output does not depend on {name} through "
                "autograd (detached, or computed outside torch?)" if mine is None
                else f"your output depends on {name} through autograd, and it should not")
    for kind, test in (("NaN", torch.isnan), ("inf", torch.isinf)):
        bad = test(mine) & torch.isfinite(want)
        if bad.any():
            first = tuple(int(i) for i in bad.nonzero()[0])
            return f"your gradient with respect to {name} is {kind} at index {first}\n{NAN_HINT}"
    return explain_difference(mine, want, tolerance, f"your gradient with respect to {name}")


GRADIENT_TOLERANCES = {"float32": (2e-3, 2e-4), "float64": (1e-6, 1e-9)}


def _grade_backward(fn, case: Case, exercise: Exercise, package: PackageRule | None, n_cases: int):
    """One backward case: the learner's gradients (forward and backward on its fresh stack), then the reference's;
    the failure to raise, or None."""
    where = f"{exercise.id}, backward case '{case.name}'"
    args, kwargs, wrt = _with_leaves(exercise, case)
    learner = functools.partial(gradients, fn, args, kwargs, wrt, exercise.backward.outputs)
    try:
        mine = _run_learner(lambda: call_on_fresh_stack(learner, (), {}, exercise.forbidden, package), exercise,
                            where)
    except (ExerciseNotDone, ExerciseFailed) as failure:
        return failure
    want = _reference_gradients(exercise, case)
    tolerance = {**GRADIENT_TOLERANCES, **exercise.backward.tolerance}
    for name in want:
        reason = _gradient_difference(mine[name], want[name], name, tolerance)
        if reason:
            return ExerciseFailed(f"{where} ({n_cases} backward cases in all):\n{reason}")
    return None


def grade(exercise: Exercise, fn, refuse_package: bool = True) -> str:
    """Every case of ``exercise``, then its backward cases; raises the first failure, else returns the line
    :func:`check` prints. ``refuse_package=False`` lets the package's own answer through (to test the grader)."""
    __tracebackhide__ = True
    package = package_rule((exercise.reference, *exercise.package), exercise.may_use) if refuse_package else None
    cases = exercise.cases()
    for case in cases:
        failure = _grade_case(fn, case, exercise, package, len(cases))
        if failure is not None:  # raised from here: your traceback shows your code, not the grader's
            raise failure.with_traceback(None)
    backward = _backward_cases(exercise) if exercise.backward is not None else []
    for case in backward:
        failure = _grade_backward(fn, case, exercise, package, len(backward))
        if failure is not None:
            raise failure.with_traceback(None)
    gradients_too = f" and {len(backward)} backward cases" if backward else ""
    return f"{exercise.id}: passed all {len(cases)} cases{gradients_too}"


def check(exercise_id: str, fn) -> None:
    """Run ``fn`` on every seeded case of ``exercise_id`` and compare it with the reference; then, for a function
    training differentiates, its gradients on the backward cases.

    Success prints one deterministic line. A stub raises :class:`ExerciseNotDone`; a wrong answer raises
    :class:`ExerciseFailed` whose message (at most three lines) names the case and what differs, never the
    expected values.
    """
    __tracebackhide__ = True
    exercise = get_exercise(exercise_id)
    if not callable(fn):
        raise TypeError(f"fn must be the function you wrote for {exercise_id}, got {describe(fn)}")
    print(grade(exercise, fn))
