"""The grading contract on the registry: references pass, stubs are 'not done', wrong answers fail."""

from __future__ import annotations

import _thread
import copy
import inspect
import os
import re
import signal
import threading
import time

import nbformat
import numpy as np
import pytest
import torch
from helpers import ROOT, notebooks, pointed_messages, wrong_answers

from k3course.grading import (
    Backward,
    Case,
    Exercise,
    ExerciseFailed,
    ExerciseNotDone,
    all_exercises,
    check,
    get_exercise,
)
from k3course.grading.check import grade
from k3course.grading.compare import explain_difference
from k3course.grading.fresh_stack import call_on_fresh_stack
from k3course.grading.isolation import ChildCrashed, can_isolate, run_isolated
from k3course.grading.notebooks import check_ids, execute
from k3course.grading.registry import _EXERCISES

EXERCISES = sorted(all_exercises())
WRONG = wrong_answers()
POINTED = pointed_messages()

# Every graded function that training differentiates (issue 51): each has a backward case.
TRAINING_PATH = {
    "01.topk_route", "01.unsort", "01.switch_aux_loss", "02.situ_glu", "02.latent_combine",
    "04.decay_step", "04.decay_attention_parallel", "04.gla_recurrent",
    "05.delta_step", "05.gdn_step", "05.gdn_recurrent", "06.kda_step", "06.kda_gate", "06.short_conv",
    "07.decayed_scores", "07.ut_transform", "07.kda_chunk_step", "09.compress_kv", "09.attention_probs",
    "09.absorb_query", "10.depth_attention", "10.block_sources", "10.block_attnres_read", "13.combine",
    "01.shared_experts", "02.latent_moe_forward", "06.kda_layer_forward", "09.gated_mla_forward", "09.mla_output_gate",
}  # 13.all_to_all's harness runs its backward on the ranks
# Chapter-local references with no package function to refuse: torch's softmax (the exercise forbids torch math).
NO_PACKAGE_FUNCTION = {"08.softmax_rows", "08.softmax_online"}


@pytest.mark.parametrize("exercise_id", EXERCISES)
def test_reference_passes_its_own_check(exercise_id):
    """The reference passes every case and every backward case (graded with the package's answer let through)."""
    assert grade(get_exercise(exercise_id), get_exercise(exercise_id).reference, refuse_package=False).startswith(
        f"{exercise_id}: passed all")


@pytest.mark.parametrize("exercise_id", EXERCISES)
def test_the_packages_own_answer_fails_the_check(exercise_id):
    """An answer that calls the package's function for the exercise (here the reference, or what a chapter-local
    reference wraps) is refused, with a message saying what is allowed."""
    reference = get_exercise(exercise_id).reference

    def calls_the_package(*args, **kwargs):
        return reference(*args, **kwargs)

    with pytest.raises(ExerciseFailed) as failure:
        check(exercise_id, calls_the_package)
    message = str(failure.value)
    assert "called the package's own " in message, message
    if "RankRaised" not in message:  # a rank's error comes back cut to one line
        assert "write it yourself with torch (from k3course you may call " in message, message


def test_the_packages_own_answer_fails_even_when_the_answer_catches_the_refusal():
    from k3course.ops.recurrent import kda_step

    def catches(state, q, k, v, g, beta):
        try:
            return kda_step(state, q, k, v, g, beta)
        except Exception:  # noqa: BLE001  (the refusal, swallowed; the answer then runs it again unrefused)
            return kda_step(state, q, k, v, g, beta)

    with pytest.raises(ExerciseFailed, match="called the package's own k3course.ops.recurrent.kda_step"):
        check("06.kda_step", catches)


def test_a_chapter_local_reference_names_the_package_function_it_wraps():
    """A reference written in the grader (a wrapper) declares the package function(s) it stands for, refused too."""
    local = {exercise_id for exercise_id, exercise in all_exercises().items()
             if exercise.reference.__module__.startswith("k3course.grading")}
    undeclared = sorted(exercise_id for exercise_id in local - NO_PACKAGE_FUNCTION
                        if not get_exercise(exercise_id).package)
    assert not undeclared, f"chapter-local references that declare no package function: {undeclared}"
    for exercise_id in local - NO_PACKAGE_FUNCTION:
        assert all(not f.__module__.startswith("k3course.grading") for f in get_exercise(exercise_id).package)


def test_every_exercise_in_the_training_path_has_a_backward_case():
    with_backward = {exercise_id for exercise_id, exercise in all_exercises().items()
                     if exercise.backward is not None}
    assert with_backward == TRAINING_PATH, (
        f"in the training path without a backward case: {sorted(TRAINING_PATH - with_backward)}; "
        f"with one but not listed here: {sorted(with_backward - TRAINING_PATH)}")
    from k3course.grading.check import _backward_cases

    for exercise_id in TRAINING_PATH:
        assert _backward_cases(get_exercise(exercise_id)), f"{exercise_id} declares a backward check with no case"


@pytest.mark.parametrize("exercise_id", ["04.decay_attention_parallel", "06.kda_step", "07.decayed_scores",
                                         "07.kda_chunk_step"])
def test_a_backward_case_sits_at_the_gates_lower_bound(exercise_id):
    """Gradients are checked where the forward is hardest: a log-decay step of -5 (K3's bound)."""
    from k3course.grading.check import _backward_cases, _named_inputs

    exercise = get_exercise(exercise_id)
    steps = []
    for case in _backward_cases(exercise):
        named = _named_inputs(exercise, case.args, case.kwargs)
        gate = named["g"] if "g" in named else named["G"].diff(dim=-2)  # G: the cumulative decay
        steps.append(float(gate.min()))
    assert min(steps) <= -5.0 + 1e-6, steps


@pytest.mark.parametrize("exercise_id", sorted(POINTED))
def test_wrong_answers_get_the_message_that_names_their_step(exercise_id):
    for wrong, said in POINTED[exercise_id]:
        with pytest.raises(ExerciseFailed) as failure:
            check(exercise_id, wrong)
        message = str(failure.value)
        assert said in message, f"{wrong.__name__}: {message}"
        assert len(message.splitlines()) <= 3, message


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
    assert "case 'seeded'" in message and "first at index (1,)" in message
    assert "7.25" not in message and "108.75" not in message  # reference values stay hidden
    assert len(message.splitlines()) == 3


def test_a_zero_answer_learns_nothing_from_its_message(toy_exercise):
    with pytest.raises(ExerciseFailed) as failure:
        check(toy_exercise, torch.zeros_like)
    message = str(failure.value)
    assert "108.75" not in message and "109" not in message and "1.09e+02" not in message  # the reference's max
    assert "50% or more" in message


def _zeroed(output):
    """The reference's output with every number set to zero (same structure, types, shapes and dtypes)."""
    if isinstance(output, torch.Tensor):
        return torch.zeros_like(output)
    if isinstance(output, np.ndarray):
        return np.zeros_like(output)
    if isinstance(output, tuple | list):
        return type(output)(_zeroed(item) for item in output)
    if isinstance(output, dict):
        return {key: _zeroed(value) for key, value in output.items()}
    return None if output is None else type(output)(0)


def _largest_number(output) -> float:
    if isinstance(output, torch.Tensor):
        return float(output.abs().max()) if output.numel() else 0.0
    if isinstance(output, np.ndarray):
        return float(np.abs(output).max()) if output.size else 0.0
    if isinstance(output, tuple | list | dict):
        items = output.values() if isinstance(output, dict) else output
        return max((_largest_number(item) for item in items), default=0.0)
    return abs(float(output)) if isinstance(output, int | float) else 0.0


@pytest.mark.parametrize("exercise_id", EXERCISES)
def test_messages_do_not_reveal_the_expected_maximum(exercise_id):
    """Answering zeros (the classic probe) fails without the message naming the largest expected value."""
    exercise = get_exercise(exercise_id)
    first = exercise.cases()[0]
    want = exercise.run(exercise.reference, copy.deepcopy(first.args), copy.deepcopy(first.kwargs))
    largest = _largest_number(want)
    with pytest.raises(ExerciseFailed) as failure:
        check(exercise_id, lambda *args, **kwargs: _zeroed(want))
    message = str(failure.value)
    assert len(message.splitlines()) <= 3, message
    reason = re.sub(r"\(rtol [^)]*\)", "", message.split("\n", 1)[-1])  # the tolerances are no secret
    shown = [float(token) for token in re.findall(r"\d+\.\d+(?:e[+-]?\d+)?|\d+e[+-]?\d+", reason)]
    assert not [x for x in shown if largest and abs(x - largest) <= 0.01 * largest], (
        f"the message shows the largest expected value ({largest:.3g}): {message}")


def test_a_scalar_message_says_how_far_only_in_bands():
    reason = explain_difference(1.2345, 1.0)
    assert "10% to 100%" in reason and "0.234" not in reason and "1.0" not in reason
    assert "more than 100%" in explain_difference(0, 17)


def test_none_against_a_tensor_is_one_short_line():
    reason = explain_difference((torch.ones(3), torch.randn(64, 64)), (torch.ones(3), None))
    assert reason == "output[1]: expected None, got a Tensor of shape (64, 64)"
    assert "tensor(" not in explain_difference(torch.randn(64, 64), 3)


def peek_at_the_graders_frames(*args, **kwargs):
    """A cheat: look up the stack for the grader's expected value."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        for name in ("want", "expected", "reference_output"):
            if name in frame.f_locals:
                return frame.f_locals[name]
        frame = frame.f_back
    raise LookupError("no expected value on the stack")


@pytest.mark.parametrize("exercise_id", EXERCISES)
def test_reading_the_expected_value_from_the_graders_frames_fails(exercise_id):
    with pytest.raises(ExerciseFailed, match="LookupError: no expected value on the stack"):
        check(exercise_id, peek_at_the_graders_frames)


def _decays(x):
    """e^x where x ≤ 0, zero above: the clamp keeps the masked entries finite, forward and backward."""
    return torch.exp(x.clamp(max=0)) * (x <= 0)


@pytest.fixture
def toy_backward():
    """A differentiated toy: its backward case holds an entry (100) whose unclamped e^x overflows float32."""
    cases = lambda: [Case("one entry past e^88", (torch.tensor([-1.0, 0.5, 100.0]),))]  # noqa: E731
    exercises = [Exercise("99.toy_decay", _decays, cases, backward=Backward(("x",))),
                 Exercise("99.toy_square", _square_without_autograd, cases,
                          backward=Backward(finite_differences=True))]
    _EXERCISES.update({exercise.id: exercise for exercise in exercises})
    yield
    for exercise in exercises:
        del _EXERCISES[exercise.id]


def test_a_nan_gradient_is_named_with_the_input_and_the_index(toy_backward):
    def masked_by_where(x):
        return torch.where(x <= 0, torch.exp(x), torch.zeros(()))

    with pytest.raises(ExerciseFailed) as failure:
        check("99.toy_decay", masked_by_where)
    message = str(failure.value)
    assert "backward case 'one entry past e^88'" in message
    assert "your gradient with respect to x is NaN at index (2,)" in message and "clamp the exponent" in message


def test_an_output_without_a_gradient_fails_its_backward_case(toy_backward):
    def detached(x):
        return torch.exp(x.detach().clamp(max=0)) * (x <= 0)

    def gradient_through_the_mask_too(x):  # the right values; d/dx of x·[0 < x ≤ 1] is 1 at 0.5
        return torch.exp(x.clamp(max=0)) * (x <= 0) + (x - x.detach()) * ((0 < x) & (x <= 1))

    with pytest.raises(ExerciseFailed, match="your output carries no gradient"):
        check("99.toy_decay", detached)
    with pytest.raises(ExerciseFailed, match="your gradient with respect to x: 1 of 3 entries are off"):
        check("99.toy_decay", gradient_through_the_mask_too)


def _square_without_autograd(x):
    """x² computed in NumPy: a reference autograd cannot differentiate."""
    return torch.from_numpy(x.detach().numpy() ** 2)


def test_finite_differences_stand_in_for_a_reference_without_autograd(toy_backward, capsys):
    check("99.toy_square", lambda x: x * x)
    assert "passed all 1 cases and 1 backward cases" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="your gradient with respect to x: 3 of 3 entries are off"):
        check("99.toy_square", lambda x: x * x.detach())  # the right square, half its gradient


def test_an_input_changed_in_place_fails_unless_the_exercise_allows_it(toy_exercise):
    def doubles_in_place(x):
        return x.mul_(2).cumsum(0) * 7.25 / 2

    with pytest.raises(ExerciseFailed, match=r"changed its input `x` in place"):
        check(toy_exercise, doubles_in_place)
    allowed = Exercise("99.toy_in_place", _EXERCISES[toy_exercise].reference, _EXERCISES[toy_exercise].cases,
                       mutable=("x",))
    _EXERCISES[allowed.id] = allowed
    try:
        check(allowed.id, lambda x: x.mul_(1).cumsum(0) * 7.25)
    finally:
        del _EXERCISES[allowed.id]


def test_a_learners_long_error_is_cut_to_its_first_line(toy_exercise):
    def raises_a_page(x):
        raise ValueError("first line\n" + "more\n" * 50)

    with pytest.raises(ExerciseFailed) as failure:
        check(toy_exercise, raises_a_page)
    assert str(failure.value).endswith("raised ValueError: first line")


def test_a_forbidden_solver_is_refused_but_forward_substitution_passes():
    from helpers import wrong_answers

    def by_solver(A_kk, beta):
        return torch.linalg.inv(torch.eye(A_kk.shape[-1], dtype=A_kk.dtype) + A_kk) * beta.unsqueeze(-2)

    with pytest.raises(ExerciseFailed, match="your code called inv: this exercise asks for forward substitution"):
        check("07.ut_transform", by_solver)
    right = next(fn for fn in wrong_answers()["07.ut_transform"] if fn.__name__ == "ut_without_beta")
    with pytest.raises(ExerciseFailed, match="wrong already with A = 0"):  # forward substitution, no solver: not
        check("07.ut_transform", right)                                    # refused, graded (it forgets β)



def test_a_rule_made_in_a_module_refuses_only_the_calls_made_through_it():
    """made_in: clip_grad_norm_'s own call of vector_norm is refused, the learner's direct call is not."""
    from k3course.grading.forbid import ForbiddenCall, refusing
    from k3course.grading.registry import Forbidden

    rule = Forbidden(frozenset({"vector_norm"}), "write the clip yourself",
                     made_in=(os.path.join("torch", "nn", "utils", ""),))
    weight = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
    weight.grad = torch.ones(3, 4)
    with refusing(rule):
        mine = torch.linalg.vector_norm(weight.grad)
        with pytest.raises(ForbiddenCall, match="your code called vector_norm: write the clip yourself"):
            torch.nn.utils.clip_grad_norm_([weight], 1.0, foreach=False)
    assert mine.item() == pytest.approx(12 ** 0.5)


@pytest.mark.skipif(not can_isolate(), reason="needs fork and no initialised CUDA")
def test_a_crashing_kernel_fails_its_check_quickly_and_names_the_cause():
    crashing = next(fn for fn in WRONG["08.l2norm_rows"] if fn.__name__ == "l2norm_unmasked_store_crashes")
    start = time.perf_counter()
    with pytest.raises(ExerciseFailed, match=r"crashed the process \(SIGSEGV\): most likely a tl.load or tl.store"):
        check("08.l2norm_rows", crashing)
    assert time.perf_counter() - start < 30


def test_a_kernel_that_stores_just_past_its_output_fails_though_its_values_are_right():
    """Its store runs 12 elements past the output it allocated: into the guard band after it (without the bands,
    into the heap, which aborts the process only when that memory is freed, if ever)."""
    past_the_end = next(fn for fn in WRONG["08.l2norm_rows"] if fn.__name__ == "l2norm_store_runs_past_the_end")
    with pytest.raises(ExerciseFailed, match=r"case '5 rows of 20 \(masked tail\)': your kernel wrote into 12 "
                                             r"element\(s\) outside the tensor your code made with empty_like "
                                             r"\(shape \(5, 20\), float32\), the farthest 12 element\(s\) past "
                                             r"its end"):
        check("08.l2norm_rows", past_the_end)


def _answers_then_aborts():
    """Returns 7, while a thread that the child waits for at exit aborts the process 3 s later, after the answer."""
    threading.Thread(target=lambda: (time.sleep(3), os.abort())).start()  # the answer goes first, even when loaded
    return 7


@pytest.mark.skipif(not can_isolate(), reason="needs fork and no initialised CUDA")
def test_a_child_that_dies_after_answering_is_a_crash():
    with pytest.raises(ChildCrashed, match=r"crashed the process after it answered \(SIGABRT\)"):
        run_isolated(_answers_then_aborts)


def test_the_learners_stack_holds_nothing_of_the_grader():
    """The learner's function runs on a thread of its own: up its stack are only that thread's frames."""
    def stack_files(*args, **kwargs):
        return [record.filename for record in inspect.stack()]

    files = call_on_fresh_stack(stack_files, (), {})
    assert files[1].endswith("fresh_stack.py") and all(f.endswith("threading.py") for f in files[2:]), files


def test_interrupting_the_check_interrupts_the_learners_function():
    """interrupt_main raises KeyboardInterrupt only where Python handles SIGINT: a test runner's worker may have
    set it otherwise (a CI run hung here), so the test sets Python's handler itself; and the "endless" function
    gives up after 30 s, so a lost interrupt fails the test instead of hanging it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can be set on the main thread only")
    deadline = time.monotonic() + 30

    def endless():
        while time.monotonic() < deadline:
            time.sleep(0.01)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            call_on_fresh_stack(endless, (), {})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not [t for t in threading.enumerate() if t.name == "k3course learner call" and t.is_alive()]


def test_a_notebook_shows_the_message_first_and_only_the_learners_frames(toy_exercise):
    def raises_inside(x):
        return x[99]

    with pytest.raises(ExerciseFailed) as failure:
        check(toy_exercise, raises_inside)
    shown = failure.value._render_traceback_()
    assert shown[0].startswith("ExerciseFailed: 99.toy_cumsum, case 'seeded': your function raised IndexError")
    assert "return x[99]" in "\n".join(shown) and "k3course/grading" not in "\n".join(shown)
    with pytest.raises(ExerciseFailed) as failure:
        check(toy_exercise, lambda x: x)
    assert failure.value._render_traceback_() == ["ExerciseFailed: " + line if i == 0 else line
                                                  for i, line in enumerate(str(failure.value).splitlines())]


@pytest.mark.skipif(not can_isolate(), reason="needs fork and no initialised CUDA")
def test_an_endless_answer_times_out():
    with pytest.raises(ChildCrashed, match="ran for more than 1 s"):
        run_isolated(lambda: time.sleep(30), timeout=1)
    assert run_isolated(lambda: torch.ones(3).sum().item()) == 3.0


@pytest.mark.skipif(not can_isolate(), reason="needs fork and no initialised CUDA")
def test_a_notebook_whose_kernel_crashes_fails_its_check_and_keeps_running(tmp_path):
    wrong = (ROOT / "tests" / "wrong" / "ch08_triton.py").read_text()
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(wrong),
        nbformat.v4.new_code_cell("from k3course.grading import check\n"
                                  'check("08.l2norm_rows", l2norm_unmasked_store_crashes)'),
        nbformat.v4.new_code_cell("print('the kernel survived')")])
    path = tmp_path / "crash.ipynb"
    nbformat.write(nb, path)
    start = time.perf_counter()
    ran, results = execute(path, timeout=60)
    assert time.perf_counter() - start < 60
    assert results[1].error_name == "ExerciseFailed" and "crashed the process" in results[1].error_value
    assert results[2].error_name is None and "the kernel survived" in ran.cells[2].outputs[0].text


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


def test_run_all_labels_name_only_cells_that_run_all_reaches():
    from k3course.grading.notebooks import CellResult, first_error_position
    from k3course.grading.progress import run_all_label

    results = [CellResult(0, (), None, None), CellResult(1, ("1.a",), "ExerciseNotDone", "1.a"),
               CellResult(3, ("1.b",), "AssertionError", "wrong")]
    stopped_at = first_error_position(results)
    assert stopped_at == 2 and first_error_position(results[:1]) is None
    assert [run_all_label(n, stopped_at) for n in (1, 2)] == ["[1]", "[2]"]
    assert run_all_label(3, stopped_at) == "code cell 3 (Run All stops before it, at the error in [2])"
    assert run_all_label(3, None) == "[3]"
    with pytest.raises(ValueError, match="position"):
        run_all_label(0, None)
