"""The Triton KDA backward (chapter 08) against the torch chunked op's gradients, and the KDA layer with it.

On a CPU the kernels run under the Triton interpreter (fp32, small shapes); the same tests run natively on a GPU.
Every comparison is fp32 against fp32, 1e-5 relative to the largest entry of the torch op's gradient.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import k3course.ops.chunk as torch_chunk  # noqa: E402
from k3course.kernels import TRITON_MODE  # noqa: E402
from k3course.kernels.kda_chunk import chunk_local_cumsum, intra_chunk_scores, kda_chunk_triton, wy_factors  # noqa: E402
from k3course.kernels.kda_chunk_backward import reverse_state_pass  # noqa: E402
from k3course.layers.kda import KimiDeltaAttention  # noqa: E402
from k3course.ops.chunk import kda_chunk  # noqa: E402

DEVICE = torch.device("cuda" if TRITON_MODE == "native" else "cpu")
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
BOUND = -5.0  # K3's lower bound on the gate
ZERO = 1e-6  # a gradient whose entries are all below this is zero but for round-off (the loss's gradients are O(1))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def backward_inputs(T, K, V, seed, decay="random", beta="random"):
    """Seeded fp32 inputs for one batch of two heads: q, k (L2-normalised), v, g ∈ [−5, 0], β, an initial state, and
    the upstream gradients of the output and of the final state."""
    gen = torch.Generator().manual_seed(seed)
    B, H = 1, 2
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    if decay == "strong":  # at the bound, within 1e-3 of it
        g = BOUND + 1e-3 * torch.rand(B, T, H, K, generator=gen)
    else:
        g = BOUND * torch.rand(B, T, H, K, generator=gen) ** 3
    b = torch.zeros(B, T, H) if beta == "zero" else torch.rand(B, T, H, generator=gen)
    tensors = (q, k, v, g, b, torch.randn(B, H, K, V, generator=gen), torch.randn(B, T, H, V, generator=gen),
               torch.randn(B, H, K, V, generator=gen))
    return [x.to(DEVICE) for x in tensors]


def gradients(op, inputs, chunk_size, with_initial, with_final):
    """The gradients of Σ o ⊙ dO (+ Σ S_T ⊙ dS_T with the final state) by q, k, v, g, β (and the initial state)."""
    *tensors, grad_o, grad_final = inputs
    leaves = [x.clone().requires_grad_() for x in tensors[:6 if with_initial else 5]]
    o, final = op(*leaves[:5], initial_state=leaves[5] if with_initial else None, output_final_state=with_final,
                  chunk_size=chunk_size, lower_bound=BOUND)
    loss = (o * grad_o).sum() + ((final * grad_final).sum() if with_final else 0.0)
    return torch.autograd.grad(loss, leaves)


def assert_triton_backward_equals_torch(inputs, chunk_size, with_initial=True, with_final=True):
    want = gradients(kda_chunk, inputs, chunk_size, with_initial, with_final)
    got = gradients(kda_chunk_triton, inputs, chunk_size, with_initial, with_final)
    for name, mine, reference in zip(NAMES, got, want):
        assert mine.shape == reference.shape and mine.dtype == reference.dtype, name
        if reference.abs().max() < ZERO:  # zero but for round-off (dg at T = 1 with no state before: g acts on 0)
            assert mine.abs().max() < ZERO, f"d{name} should vanish, got {mine.abs().max():.2e}"
        else:
            assert relative_error(mine, reference) <= 1e-5, f"d{name}: {relative_error(mine, reference):.2e}"


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_triton_backward_equals_torch_for_every_chunk_size_with_k_unlike_v_and_a_ragged_t(chunk_size):
    """T = 70 is not a multiple of any chunk size; K = 16 ≠ V = 24; initial and final state."""
    assert_triton_backward_equals_torch(backward_inputs(70, 16, 24, seed=chunk_size), chunk_size)


@pytest.mark.parametrize("T, chunk_size", [(1, 16), (5, 64), (20, 32)])
@pytest.mark.parametrize("with_initial, with_final", [(False, False), (True, False), (False, True)])
def test_triton_backward_for_short_sequences_with_and_without_states(T, chunk_size, with_initial, with_final):
    """T = 1, T < C, and T between chunks; the initial state's gradient; a gradient into the final state or none."""
    assert_triton_backward_equals_torch(backward_inputs(T, 16, 16, seed=T), chunk_size, with_initial, with_final)


def test_triton_backward_under_strong_decay_at_the_lower_bound():
    """g within 1e-3 of −5 on every channel: e^{G_r − G_i} spans e^0 … e^{−315} inside a 64-token chunk.

    Here the fp32 torch op is itself 2e-5 off in dg (float64 is the judge): dg sums terms far larger than itself
    (dG = Q ⊙ dQ + K ⊙ (dK₊ − dK₋), then suffix sums), so both fp32 rungs lose the same few bits. The Triton
    gradients must be within 1e-5 of float64's (dg: within 4e-5 and no further than twice the torch op's error)."""
    inputs = backward_inputs(100, 16, 32, seed=3, decay="strong")
    exact = gradients(kda_chunk, [x.double() for x in inputs], 64, True, True)
    torch_fp32 = gradients(kda_chunk, inputs, 64, True, True)
    got = gradients(kda_chunk_triton, inputs, 64, True, True)
    for name, mine, reference, theirs in zip(NAMES, got, exact, torch_fp32):
        error = relative_error(mine, reference)
        if name == "g":
            assert error <= min(4e-5, 2 * relative_error(theirs, reference)), f"dg: {error:.2e}"
        else:
            assert error <= 1e-5, f"d{name}: {error:.2e}"


def test_triton_backward_with_beta_zero():
    """β = 0: no delta update (the state only decays), yet dβ is not zero."""
    inputs = backward_inputs(40, 16, 16, seed=5, beta="zero")
    assert_triton_backward_equals_torch(inputs, 16)
    assert gradients(kda_chunk_triton, inputs, 16, True, True)[4].abs().max() > 0


def test_triton_backward_with_wide_heads_and_several_value_blocks():
    """K = 40: two key blocks of 32, masked channels in the second; V = 80: several value blocks in both kernels."""
    assert_triton_backward_equals_torch(backward_inputs(24, 40, 80, seed=6), 16)



def test_reverse_state_pass_gives_the_gradient_of_every_state_between_chunks():
    """The reverse pass alone (chapter 08's exercise): dS' of chunk c is the gradient of the state that chapter 07's
    torch op hands from chunk c to chunk c + 1 when the sequence runs piece by piece (each piece's final state the
    next one's initial state), dS' of the last chunk is dS_T, and dS_0 is the initial state's gradient. T = 45:
    three chunks of 16, the last partial; K = 16 ≠ V = 24."""
    T, C = 45, 16
    q, k, v, g, beta, h0, grad_o, grad_final = backward_inputs(T, 16, 24, seed=8)
    states, outputs = [h0.clone().requires_grad_()], []
    for start in range(0, T, C):
        piece = slice(start, start + C)
        o, final = kda_chunk(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece],
                             initial_state=states[-1], output_final_state=True, chunk_size=C)
        outputs.append(o)
        states.append(final)
    loss = (torch.cat(outputs, 1) * grad_o).sum() + (states[-1] * grad_final).sum()
    want = torch.autograd.grad(loss, states[:-1])  # the initial state, then the state entering chunks 1 and 2
    gc = chunk_local_cumsum(g, C)
    scale = 16 ** -0.5
    akk, aqk = intra_chunk_scores(q, k, gc, beta, scale, C)
    w, _ = wy_factors(k, v, gc, beta, akk, C)
    grad_leaving, _, grad_initial = reverse_state_pass(q, k, gc, w, aqk, grad_o, grad_final, scale)
    assert relative_error(grad_initial, want[0]) <= 1e-5
    for chunk, reference in enumerate([*want[1:], grad_final]):
        assert relative_error(grad_leaving[:, chunk], reference) <= 1e-5, f"dS' of chunk {chunk}"
    with pytest.raises(ValueError, match="grad_final_state must be"):
        reverse_state_pass(q, k, gc, w, aqk, grad_o, grad_final[..., :5], scale)

def test_triton_backward_replays_nothing_of_the_torch_op(monkeypatch):
    """The backward runs the Triton kernels only: the torch chunked op (and its written-out backward,
    ``_BoundedKDAChunks``) is never called, and the graph holds the Triton function's backward node alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton backward called the torch chunked op")

    monkeypatch.setattr(torch_chunk, "_chunk_core", refuse)
    monkeypatch.setattr(torch_chunk._BoundedKDAChunks, "apply", refuse)
    q, k, v, g, beta, h0, grad_o, grad_final = backward_inputs(20, 16, 16, seed=7)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = kda_chunk_triton(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=16)
    assert type(o.grad_fn).__name__ == "_KDAChunkFunctionBackward"
    with torch.autograd.profiler.profile() as profile:
        ((o * grad_o).sum() + (final * grad_final).sum()).backward()
    assert not [event.name for event in profile.function_events if "_BoundedKDAChunks" in event.name]
    assert all(leaf.grad is not None for leaf in leaves)


def _layer_gradients(layer, x, backend, monkeypatch):
    """The KDA layer's output, final state and gradients (x and every parameter) with the kernel backend."""
    layer.kernels = backend
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y, cache = layer(x)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    ((y * weights).sum() + cache.state.sum()).backward()
    return {"y": y.detach(), "state": cache.state.detach(), "x": x.grad,
            **{name: p.grad.clone() for name, p in layer.named_parameters()}}


@pytest.mark.parametrize("lower_bound", [-5.0, -1.0])
def test_kda_layer_triton_gradients_equal_torch(monkeypatch, lower_bound):
    """The layer forced onto the Triton kernels gives the torch layer's output, state and parameter gradients."""
    torch.manual_seed(0)
    layer = KimiDeltaAttention(32, 2, 16, chunk_size=32, lower_bound=lower_bound).to(DEVICE)
    x = torch.randn(1, 37, 32, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    want = _layer_gradients(layer, x, "torch", monkeypatch)
    got = _layer_gradients(layer, x, "triton", monkeypatch)
    for name in want:
        assert relative_error(got[name], want[name]) <= 1e-5, f"{name}: {relative_error(got[name], want[name]):.2e}"
