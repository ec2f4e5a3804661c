"""The grouped GEMM's backward (chapter 08): dX through the transposed grouped product, dW as a grouped
reduction, one Triton launch each, the group offsets never read back to the host.

Against torch's autograd through one fp64 matmul per expert. On a CPU they run under the Triton interpreter
(fp32, small shapes); the same tests run natively on a GPU.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import k3course.kernels.grouped_gemm as grouped_gemm
from k3course.kernels import TRITON_MODE
from k3course.kernels.grouped_gemm import moe_grouped_gemm

DEVICE = torch.device("cuda" if TRITON_MODE == "native" else "cpu")


def per_expert_reference(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ weights[e] in fp64, one matmul per expert; rows past the last end are
    zero (they belong to no expert, so their gradient is zero)."""
    out = torch.zeros(x.shape[0], weights.shape[2], dtype=torch.float64, device=x.device)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end].double() @ weights[expert].double()
        start = end
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want| (0 when both are zero)."""
    error = (got.double() - want.double()).abs().max()
    return (error / want.double().abs().max().clamp_min(1e-30)).item()


def seeded_problem(counts: list[int], k: int, n: int, spare_rows: int = 0, seed: int = 0):
    """x [Σ counts + spare_rows, k], weights [E, k, n] (both requiring grad), int32 end offsets [E], and a
    seeded upstream gradient [M, n]."""
    generator = torch.Generator().manual_seed(seed)
    rows = sum(counts) + spare_rows
    ends = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    x = torch.randn(rows, k, generator=generator).to(DEVICE).requires_grad_()
    weights = torch.randn(len(counts), k, n, generator=generator).to(DEVICE).requires_grad_()
    grad_out = torch.randn(rows, n, generator=generator).to(DEVICE)
    return x, weights, ends, grad_out


CASES = {
    "ragged with empty experts": [5, 0, 17, 1, 0, 40, 3],
    "one row each": [1, 1, 1, 1],
    "one hot expert among empty ones": [0, 0, 37, 0],
    "a single expert": [33],
    "empty first and last": [0, 4, 0],
}


@pytest.mark.parametrize("k, n", [(24, 40), (40, 72)])
@pytest.mark.parametrize("counts", CASES.values(), ids=CASES.keys())
def test_gradients_equal_the_per_expert_reference(counts, k, n):
    """dX and dW equal autograd through per-expert fp64 matmuls to 1e-5 relative to the largest entry; K and N
    span several blocks or part of one."""
    x, weights, ends, grad_out = seeded_problem(counts, k, n, seed=len(counts) + k)
    grad_x, grad_w = torch.autograd.grad(moe_grouped_gemm(x, weights, ends), (x, weights), grad_out)
    want_x, want_w = torch.autograd.grad(per_expert_reference(x, weights, ends), (x, weights), grad_out.double())
    assert grad_x.shape == x.shape and grad_w.shape == weights.shape and grad_w.dtype == weights.dtype
    assert relative_error(grad_x, want_x) <= 1e-5
    assert relative_error(grad_w, want_w) <= 1e-5
    for expert, count in enumerate(counts):
        if count == 0:
            assert not grad_w[expert].any(), f"expert {expert} has no rows: its gradient must be exactly zero"


def test_rows_past_the_last_end_get_a_zero_input_gradient():
    x, weights, ends, grad_out = seeded_problem([3, 0, 5], 24, 40, spare_rows=6, seed=3)
    grad_x, grad_w = torch.autograd.grad(moe_grouped_gemm(x, weights, ends), (x, weights), grad_out)
    want_x, want_w = torch.autograd.grad(per_expert_reference(x, weights, ends), (x, weights), grad_out.double())
    assert not grad_x[8:].any()
    assert relative_error(grad_x, want_x) <= 1e-5 and relative_error(grad_w, want_w) <= 1e-5


def test_no_rows_at_all_gives_zero_weight_gradient():
    x, weights, ends, grad_out = seeded_problem([0, 0], 16, 16)
    grad_x, grad_w = torch.autograd.grad(moe_grouped_gemm(x, weights, ends), (x, weights), grad_out)
    assert grad_x.shape == (0, 16) and grad_w.shape == (2, 16, 16) and not grad_w.any()


def test_gradient_reaches_strided_weights_and_only_what_needs_it():
    """Weights used through a transpose get their gradient in the view's layout; with x not requiring grad,
    only dW is computed (and still equals the reference)."""
    generator = torch.Generator().manual_seed(4)
    ends = torch.tensor([3, 3, 20], dtype=torch.int32, device=DEVICE)
    x = torch.randn(20, 16, generator=generator).to(DEVICE)
    stored = torch.randn(3, 48, 16, generator=generator).to(DEVICE).requires_grad_()   # [E, N, K]
    grad_out = torch.randn(20, 48, generator=generator).to(DEVICE)
    (grad_stored,) = torch.autograd.grad(moe_grouped_gemm(x, stored.transpose(1, 2), ends), stored, grad_out)
    (want,) = torch.autograd.grad(per_expert_reference(x, stored.transpose(1, 2), ends), stored, grad_out.double())
    assert relative_error(grad_stored, want) <= 1e-5


class CountingKernel:
    """Wraps a launched ``kernel[grid](...)`` and counts the launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            self.launches += 1
            return launch(*args, **kwargs)

        return counted


def test_backward_is_one_launch_for_dx_and_one_for_dw(monkeypatch):
    product = CountingKernel(grouped_gemm._grouped_gemm_kernel)
    reduction = CountingKernel(grouped_gemm._grouped_weight_grad_kernel)
    monkeypatch.setattr(grouped_gemm, "_grouped_gemm_kernel", product)
    monkeypatch.setattr(grouped_gemm, "_grouped_weight_grad_kernel", reduction)
    x, weights, ends, grad_out = seeded_problem(CASES["ragged with empty experts"], 24, 40)
    out = moe_grouped_gemm(x, weights, ends)
    assert (product.launches, reduction.launches) == (1, 0)
    out.backward(grad_out)
    assert (product.launches, reduction.launches) == (2, 1)


def test_forward_and_backward_read_nothing_back_to_the_host():
    """No scalar read (``aten::_local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``) and no
    ``Tensor.tolist`` in the forward or the backward: the offsets stay on the device."""
    x, weights, ends, grad_out = seeded_problem(CASES["ragged with empty experts"], 24, 40)
    original_tolist, listed = torch.Tensor.tolist, []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile, \
            mock.patch.object(torch.Tensor, "tolist", lambda t: listed.append(tuple(t.shape)) or original_tolist(t)):
        moe_grouped_gemm(x, weights, ends).backward(grad_out)
    scalar_reads = [event.name for event in profile.events() if event.name == "aten::_local_scalar_dense"]
    assert (scalar_reads, listed) == ([], [])
    assert x.grad is not None and weights.grad is not None
