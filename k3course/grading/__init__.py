"""Grading for the exercise notebooks: ``check("<exercise id>", your_fn)``.

See the README's "Doing the exercises". The registry lives in :mod:`k3course.grading.registry`, one module per
chapter in :mod:`k3course.grading.chapters`; notebook execution for ``k3course progress`` and the contract tests in
:mod:`k3course.grading.notebooks`; what ``k3course progress`` prints in :mod:`k3course.grading.progress`.
"""

from k3course.grading.check import ExerciseFailed, ExerciseNotDone, check
from k3course.grading.demo import yours_or_package
from k3course.grading.registry import Backward, Case, Exercise, Probe, all_exercises, get_exercise, register

__all__ = ["Backward", "Case", "Exercise", "ExerciseFailed", "ExerciseNotDone", "Probe", "all_exercises", "check",
           "get_exercise", "register", "yours_or_package"]
