"""Grading for the exercise notebooks: ``check("<exercise id>", your_fn)``.

See the README's "Doing the exercises". The registry lives in :mod:`k3course.grading.registry`, one module per
chapter in :mod:`k3course.grading.chapters`; notebook execution for ``k3course progress`` and the contract tests in
:mod:`k3course.grading.notebooks`; what ``k3course progress`` prints in :mod:`k3course.grading.progress`.

What a check does, and how a new exercise asks for it: every mechanism is data on its
:class:`~k3course.grading.registry.Exercise` in ``register(Exercise(...))``; nothing is per exercise in the grader.

- **Cases** (``cases``): the learner's function runs first on a copy of each seeded case, then the reference;
  inputs changed in place fail unless named in ``mutable``; ``forbidden`` refuses torch functions.
- **The package's own answer is refused**, always: while the answer runs, a call of the reference's code (any
  import path, or inside another package function) fails with a message saying what the answer may use. A
  chapter-local reference (a wrapper in the grader) names the package function it stands for in ``package``, and
  any public function that computes the same answer goes there too (``package=(kda_chunk,)``). ``may_use`` names
  the package functions the exercise lets an answer call (the exercise's text says so as well).
  ``tests/test_grading.py`` tries the package's answer on every registered id.
- **Backward cases** (``backward=Backward(...)``), for every function training differentiates: the gradients of
  L = Σ_i ⟨w_i, output_i⟩ (seeded w_i) with respect to the inputs ``wrt`` (default: every floating tensor input)
  must be finite where the reference's are and equal to autograd through the reference (or, with
  ``finite_differences=True``, to float64 central differences of it). Without ``cases`` the exercise's own
  float32/float64 cases are used, so put a case at the gate's lower bound (g = −5, a long chunk) among them.
  ``outputs`` picks the outputs training differentiates. A NaN reads "your gradient with respect to g is NaN at
  index ...". Add the id to ``TRAINING_PATH`` in ``tests/test_grading.py``.
- **Probes** (``probes=`` a function returning ``[Probe(case, label, hint), ...]``, simplest first), for a
  multi-step exercise: when a case fails, the probes run in order and the first that fails names its step:
  "correct with β = 0 (and 2 simpler variants); wrong with an incoming state and g = 0: check how the state
  enters: Ṽ = U − W S". Each probe switches parts off (state = 0, β = 0, g = 0, one chunk, a channel-constant
  gate); a hint says where to look, never an expected value. ``tests/wrong/chNN_*.py``'s ``POINTED`` pins the
  message each plausible mistake gets.
- **Triton exercises** (``forbidden=TORCH_MATH``, ``isolate=True``, ``guard_bands=True``): torch maths in the
  answer is refused (torch only allocates), the answer runs in a forked child (a crash or a hang fails one check),
  and every tensor it is given or allocates sits between guard bands (:mod:`k3course.grading.guard_bands`) that
  must come back untouched: a store just outside a tensor, which crashes nothing, fails with the tensor, the side
  and the distance. ``tests/test_guard_bands.py`` checks every exercise that refuses torch maths has them.
- **Demo cells** after an exercise run the learner's function through :func:`yours_or_package`, which falls
  back to the package's (and says so) while the learner's is still the stub.
"""

from k3course.grading.check import ExerciseFailed, ExerciseNotDone, check
from k3course.grading.demo import yours_or_package
from k3course.grading.registry import Backward, Case, Exercise, Probe, all_exercises, get_exercise, register

__all__ = ["Backward", "Case", "Exercise", "ExerciseFailed", "ExerciseNotDone", "Probe", "all_exercises", "check",
           "get_exercise", "register", "yours_or_package"]
