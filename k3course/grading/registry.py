"""The exercise registry: exercise id -> reference function, seeded cases and tolerances.

Each chapter registers its exercises in ``k3course/grading/chapters/chNN_*.py`` with :func:`register`.
The chapter modules are imported on first use, so adding a chapter never touches this file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    """One seeded input for an exercise: ``fn(*args, **kwargs)``; ``name`` says what it probes."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Forbidden:
    """Torch functions an exercise's answer must not call (matched by name), and why, for the message.

    Only calls made from the learner's own code count: torch's and Triton's internals may call anything.
    every_call: refuse every torch function and tensor method the learner calls (a NumPy rung's answer).
    made_in: when given, only the calls made through one of these torch modules (path fragments, e.g.
    ``torch/distributed/nn/``) count: a shortcut that wraps a function the answer may call itself.
    """

    names: frozenset[str]
    why: str
    made_in: tuple[str, ...] = ()
    every_call: bool = False  # refuse every torch call of the learner's, whatever its name (a NumPy exercise)


NUMPY_ONLY = Forbidden(frozenset(), "this exercise is the NumPy rung: write it with NumPy arrays, no torch",
                       every_call=True)


@dataclass(frozen=True)
class Backward:
    """The gradient check of an exercise whose function training differentiates.

    wrt:       the inputs (parameter names) the gradients are taken with respect to; None: every input that is a
               floating tensor or a list of them.
    outputs:   the positions, among the output's floating tensors (nested in order), of those training
               differentiates (the loss is Σ_i ⟨w_i, output_i⟩ over them, w_i seeded); None: all of them.
    cases:     builds the backward cases; None: the exercise's own cases in which every named input is a float32
               or float64 tensor (so a case at the gate's lower bound is a backward case too).
    finite_differences: compare with float64 central differences of the reference (for a reference that has no
               autograd, e.g. a kernel without a backward) instead of autograd through it.
    tolerance: {dtype name: (rtol, atol)} for the gradients; the default table is looser than the forward's.
    """

    wrt: tuple[str, ...] | None = None
    outputs: tuple[int, ...] | None = None
    cases: Callable[[], list[Case]] | None = None
    finite_differences: bool = False
    tolerance: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Probe:
    """A diagnostic variant of a multi-step exercise: a case that switches parts of the computation off.

    label: what the variant is, as it reads after "correct" / "wrong" ("with no incoming state (S = 0)").
    hint:  where to look when this variant is the first one that fails ("check how the state enters W").
    """

    case: Case
    label: str
    hint: str


@dataclass(frozen=True)
class Exercise:
    """An exercise the learner solves and :func:`k3course.grading.check` grades.

    id:        "NN.name", e.g. "01.topk_route" (NN = chapter).
    reference: the package function the learner's answer is compared with.
    cases:     builds the seeded input cases (called fresh for every check, so inputs can't leak state).
    tolerance: optional {dtype name: (rtol, atol)} overriding the default table for this exercise.
    mutable:   names of the arguments the exercise allows to change in place (every other input must come
               back unchanged).
    forbidden: torch functions the answer must not call (e.g. a triangular solver), or None.
    isolate:   run the answer in a forked child process, so that a crash (a Triton kernel's unmasked store)
               or a hang fails the check with a message instead of killing the notebook's kernel.
    harness:   how an answer runs on a case, for answers that can't simply be called (a collective runs on
               ranks the harness starts): ``harness(answer, *case.args, **case.kwargs)`` -> what is compared;
               the answer and the reference go through it alike. None: ``answer(*case.args, **case.kwargs)``.
    backward:  the gradient check, for a function that training differentiates (see :class:`Backward`).
    probes:    builds the diagnostic variants of a multi-step exercise, simplest first (see :class:`Probe`): when
               a case fails, the first variant that fails too names the step to look at.
    package:   package functions that answer this exercise, refused in an answer like the reference itself is
               (a chapter-local reference's wrapped function, a public function that does the same).
    may_use:   the package functions the exercise lets an answer call (named in the refusal's message).
    guard_bands: run the answer with every tensor it is given or allocates inside guard bands, and fail it when
               its kernel writes into one (:mod:`k3course.grading.guard_bands`): every Triton exercise has them.
    """

    id: str
    reference: Callable[..., Any]
    cases: Callable[[], list[Case]]
    tolerance: dict[str, tuple[float, float]] = field(default_factory=dict)
    mutable: tuple[str, ...] = ()
    forbidden: Forbidden | None = None
    isolate: bool = False
    harness: Callable[..., Any] | None = None
    backward: Backward | None = None
    probes: Callable[[], list[Probe]] | None = None
    package: tuple[Callable[..., Any], ...] = ()
    may_use: tuple[str, ...] = ()
    guard_bands: bool = False

    def run(self, answer: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``answer`` on one case's inputs: through the harness when the exercise has one."""
        if self.harness is None:
            return answer(*args, **kwargs)
        return self.harness(answer, *args, **kwargs)


_EXERCISES: dict[str, Exercise] = {}
_loaded = False


def register(exercise: Exercise) -> Exercise:
    """Add ``exercise`` to the registry; ids are unique."""
    if exercise.id in _EXERCISES:
        raise ValueError(f"exercise id {exercise.id!r} is registered twice")
    _EXERCISES[exercise.id] = exercise
    return exercise


def _load_chapters() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from k3course.grading import chapters

    for module in sorted(pkgutil.iter_modules(chapters.__path__), key=lambda m: m.name):
        importlib.import_module(f"{chapters.__name__}.{module.name}")


def get_exercise(exercise_id: str) -> Exercise:
    """The registered exercise ``exercise_id``; an unknown id lists the known ones."""
    _load_chapters()
    if not isinstance(exercise_id, str) or exercise_id not in _EXERCISES:
        known = ", ".join(sorted(_EXERCISES)) or "(none)"
        raise KeyError(f"exercise_id {exercise_id!r} is not a registered exercise; known: {known}")
    return _EXERCISES[exercise_id]


def all_exercises() -> dict[str, Exercise]:
    """Every registered exercise, by id."""
    _load_chapters()
    return dict(sorted(_EXERCISES.items()))
