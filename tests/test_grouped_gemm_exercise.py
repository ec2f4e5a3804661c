"""Chapter 08's grouped GEMM exercise: the grader's reference (one torch matmul per expert) equals the package's
grouped GEMM op on every case, and the solved notebook's kernel equals it too, then runs as the experts' part."""

from __future__ import annotations

import torch
from helpers import ROOT

from k3course.grading import get_exercise
from k3course.kernels.grouped_gemm import moe_grouped_gemm
from k3course.lessons.capstone import notebook_functions
from k3course.moe import LatentMoE
from k3course.parts import use_parts


def relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def test_the_reference_equals_the_package_grouped_gemm_op_on_every_case():
    exercise = get_exercise("08.grouped_gemm")
    for case in exercise.cases():
        torch.testing.assert_close(exercise.reference(*case.args), moe_grouped_gemm(*case.args), rtol=1e-5,
                                   atol=1e-5, msg=case.name)


def test_the_solved_kernel_equals_the_package_op_and_runs_as_the_experts_part():
    grouped_gemm = notebook_functions(ROOT / "solutions" / "08_triton_exercises.ipynb", ["grouped_gemm"])[0][
        "grouped_gemm"]
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(30, 20, generator=gen), torch.randn(5, 20, 12, generator=gen)
    ends = torch.tensor([0, 11, 11, 29, 30], dtype=torch.int32)  # experts 0 and 2 empty
    assert relative(grouped_gemm(x, w, ends), moe_grouped_gemm(x, w, ends)) <= 1e-6
    layer = LatentMoE(32, 8, 2, expert_dim=16, generator=torch.Generator().manual_seed(1)).eval()
    tokens = torch.randn(1, 6, 32, generator=gen)
    calls = []

    def counted(*args):
        calls.append(args[2].dtype)
        return grouped_gemm(*args, block=32)

    with torch.no_grad():
        want = layer(tokens)
        with use_parts(grouped_gemm=counted):
            got = layer(tokens)
    assert len(calls) == 2  # the bank's two products: gate-up, then down
    assert relative(got, want) <= 1e-5


def test_lesson_08_does_not_print_the_packages_grouped_gemm_kernel():
    """The exercise's reference is the grader's torch loop, so the answer-in-lesson test does not reach the
    package's kernel: it is checked here, as a token run of the same length (test_no_answer_in_lesson)."""
    from test_no_answer_in_lesson import LONG_RUN, _body, _ngrams, code_tokens, lesson_streams

    from k3course.kernels import grouped_gemm

    kernel = _ngrams(code_tokens(_body(grouped_gemm._grouped_gemm_kernel.fn.fn)), LONG_RUN)
    printed = {gram for _, stream in lesson_streams(ROOT / "notebooks" / "08_triton.ipynb")
               for gram in _ngrams(stream, LONG_RUN)}
    assert len(kernel) > 0 and not kernel & printed
