"""Chunked KDA / GDN against the recurrent ops over the whole allowed gate range, forward and every input gradient.

Gates from mild (−0.1 per token) to K3's lower bound (−5 per token and channel), constant and random, at chunk
16, 32 and 64, with T not a multiple of the chunk and an initial state: no NaN, relative error ≤ 1e-4 in fp32
(the error is measured as ‖got − want‖ / ‖want‖ over the whole tensor). The Triton chunk op, forward and
backward kernels, is checked the same way under the interpreter on smaller shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3course.layers.kda import KDA_LOWER_BOUND
from k3course.ops.chunk import gdn_chunk, kda_chunk
from k3course.ops.recurrent import gdn_recurrent, kda_recurrent

TOLERANCE = 1e-4
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
GATES = ("-0.1", "-3", "lower bound", "uniform", "layer")


def gate(kind: str, shape, gen) -> torch.Tensor:
    """A log-decay g of ``shape``: constant (−0.1, −3, the lower bound), uniform in [lower bound, −0.1], or the
    K3 layer's distribution −5·σ(z) with z ~ N(0, 2²) (down to the lower bound)."""
    if kind == "uniform":
        return KDA_LOWER_BOUND + (-0.1 - KDA_LOWER_BOUND) * torch.rand(shape, generator=gen)
    if kind == "layer":
        return KDA_LOWER_BOUND * torch.sigmoid(2 * torch.randn(shape, generator=gen))
    return torch.full(shape, KDA_LOWER_BOUND if kind == "lower bound" else float(kind))


def inputs(kind: str, scalar_gate: bool, T=100, H=2, K=16, V=16, seed=0):
    """q, k (unit norm), v, g (``[B, T, H]`` for GDN, ``[B, T, H, K]`` for KDA), beta, initial_state; B = 1."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, T, H, K, generator=gen), F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v, beta = torch.randn(1, T, H, V, generator=gen), torch.rand(1, T, H, generator=gen)
    g = gate(kind, (1, T, H) if scalar_gate else (1, T, H, K), gen)
    return q, k, v, g, beta, torch.randn(1, H, K, V, generator=gen)


def outputs_and_gradients(op, tensors, **options):
    """Run ``op`` on fresh leaves, backpropagate a fixed random weighting of (o, final state); returns
    ``[o, final_state, dq, dk, dv, dg, dbeta, dinitial_state]``."""
    leaves = [x.clone().requires_grad_() for x in tensors]
    o, final = op(*leaves[:5], initial_state=leaves[5], output_final_state=True, **options)
    gen = torch.Generator().manual_seed(123)
    weights_o, weights_s = torch.randn(o.shape, generator=gen), torch.randn(final.shape, generator=gen)
    ((o * weights_o).sum() + (final * weights_s).sum()).backward()
    return [o.detach(), final.detach()] + [x.grad for x in leaves]


def assert_all_close(got, want, label: str) -> None:
    """got, want: [o, final_state, dq, ...] or a prefix of it, e.g. [o, final_state]."""
    names = ("o", "final_state", *(f"d{n}" for n in NAMES))[:len(want)]
    for name, x, y in zip(names, got, want, strict=True):
        assert x is not None and torch.isfinite(x).all(), f"{label}: {name} has NaN/inf or is missing"
        error = ((x.double() - y.double()).norm() / y.double().norm()).item()
        assert error <= TOLERANCE, f"{label}: {name} relative error {error:.2e} > {TOLERANCE:g}"


_REFERENCES: dict = {}


def reference(kind: str, scalar_gate: bool):
    """The recurrent op's outputs and gradients, computed once per gate."""
    key = (kind, scalar_gate)
    if key not in _REFERENCES:
        op = gdn_recurrent if scalar_gate else kda_recurrent
        _REFERENCES[key] = outputs_and_gradients(op, inputs(kind, scalar_gate))
    return _REFERENCES[key]


@pytest.mark.parametrize("scalar_gate", [False, True], ids=["kda", "gdn"])
@pytest.mark.parametrize("kind", GATES)
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunked_matches_recurrent_forward_and_all_gradients(kind, scalar_gate, chunk_size):
    op = gdn_chunk if scalar_gate else kda_chunk
    got = outputs_and_gradients(op, inputs(kind, scalar_gate), chunk_size=chunk_size)
    assert_all_close(got, reference(kind, scalar_gate), f"{'gdn' if scalar_gate else 'kda'} g={kind} C={chunk_size}")


def test_issue_repro_constant_gate_minus_3_chunk_64_has_finite_gate_gradient():
    """The reported case: g = −3, chunk 64, T = 128, H = 2, K = V = 16 gave NaN in ~1,500 entries of dL/dg."""
    tensors = inputs("-3", scalar_gate=False, T=128)
    got = outputs_and_gradients(kda_chunk, tensors, chunk_size=64)
    assert_all_close(got, outputs_and_gradients(kda_recurrent, tensors), "g = -3, C = 64, T = 128")


def test_chunk_path_reads_nothing_back_to_the_host():
    """The score path is chosen statically: a chunked forward and backward make no device→host read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountHostReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                CountHostReads.count += 1
            return func(*args, **(kwargs or {}))

    leaves = [x.requires_grad_() for x in inputs("layer", scalar_gate=False, T=40)]
    with CountHostReads():
        for lower_bound in (None, KDA_LOWER_BOUND):
            o, final = kda_chunk(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=16,
                                 lower_bound=lower_bound)
            (o.sum() + final.sum()).backward()
    assert CountHostReads.count == 0


@pytest.mark.parametrize("kind", ["lower bound", "layer"])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_triton_chunk_op_matches_recurrent_forward_and_all_gradients(kind, chunk_size):
    kernels = pytest.importorskip("k3course.kernels")
    if kernels.TRITON_MODE == "unavailable":
        pytest.skip("triton is not installed")
    from k3course.kernels.kda_chunk import kda_chunk_triton

    device = torch.device("cuda" if kernels.TRITON_MODE == "native" else "cpu")
    tensors = [x.to(device) for x in inputs(kind, scalar_gate=False, T=40, H=1)]
    got = outputs_and_gradients(kda_chunk_triton, tensors, chunk_size=chunk_size)
    want = outputs_and_gradients(kda_recurrent, tensors)
    assert_all_close(got, want, f"triton g={kind} C={chunk_size}")


@pytest.mark.parametrize("op", [kda_chunk, kda_recurrent, gdn_chunk, gdn_recurrent], ids=lambda op: op.__name__)
def test_bf16_activations_with_a_float32_state(op):
    """bf16 q/k/v/g/beta with an fp32 initial state: o in bf16, the final state in fp32, close to the fp32 run;
    the returned state continues the sequence (prefill, then the next tokens from that state)."""
    scalar_gate = op in (gdn_chunk, gdn_recurrent)
    q, k, v, g, beta, s0 = inputs("layer", scalar_gate, T=40)
    o, final = op(*(x.bfloat16() for x in (q, k, v, g, beta)), initial_state=s0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    as_bf16 = [x.bfloat16().float() for x in (q, k, v, g, beta)]  # the same values, computed in fp32
    o_32, final_32 = op(*as_bf16, initial_state=s0, output_final_state=True)
    assert ((o.float() - o_32).norm() / o_32.norm()).item() < 1e-2
    assert ((final - final_32).norm() / final_32.norm()).item() < 1e-3
    first, rest = (tuple(x[:, :25].bfloat16() for x in (q, k, v, g, beta)),
                   tuple(x[:, 25:].bfloat16() for x in (q, k, v, g, beta)))
    _, middle = op(*first, initial_state=s0, output_final_state=True)
    o_rest, final_rest = op(*rest, initial_state=middle, output_final_state=True)
    assert middle.dtype == final_rest.dtype == torch.float32
    assert ((o_rest.float() - o[:, 25:].float()).norm() / o[:, 25:].float().norm()).item() < 1e-2
    with pytest.raises(TypeError, match="initial_state"):
        op(*(x.bfloat16() for x in (q, k, v, g, beta)), initial_state=s0.double())


# --- the bounded-gate fast form: kda_chunk(..., lower_bound=L) ------------------------------------------------

BOUND = KDA_LOWER_BOUND


@pytest.mark.parametrize("kind", ["-3", "lower bound", "uniform", "layer"])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_bounded_path_matches_recurrent_forward_and_all_gradients(kind, chunk_size):
    """lower_bound = −5 (16-token sub-chunks referenced at their first token, one product per chunk): the
    recurrent op's outputs and every input gradient, T = 100 (not a multiple of C), with an initial state."""
    got = outputs_and_gradients(kda_chunk, inputs(kind, scalar_gate=False), chunk_size=chunk_size,
                                lower_bound=BOUND)
    assert_all_close(got, reference(kind, scalar_gate=False), f"bounded g={kind} C={chunk_size}")


def exact_scores(a, b, G, strict: bool) -> torch.Tensor:
    """Σ_d a_rd b_id e^{G_rd − G_id} (i < r, or i ≤ r), every pair formed on its own in float64."""
    a, b, G = a.double(), b.double(), G.double()
    weights = torch.exp((G.unsqueeze(-2) - G.unsqueeze(-3)).clamp(max=0))  # [..., r, i, K]
    return (a.unsqueeze(-2) * b.unsqueeze(-3) * weights).sum(-1).tril(-1 if strict else 0)


@pytest.mark.parametrize("C", [1, 10, 16, 24, 64, 100])
@pytest.mark.parametrize("strict", [False, True])
def test_bounded_scores_equal_the_float64_pairwise_sum(C, strict):
    """Every entry of A, near the diagonal and far from it, at the bound and above it, for chunks that are not
    whole sub-chunks: a chunk-wide reference (e^{−G} up to e^320) or a wrong bridge between sub-chunks fails."""
    from k3course.ops.chunk import decayed_scores

    gen = torch.Generator().manual_seed(C)
    a, b = torch.randn(3, C, 16, generator=gen), F.normalize(torch.randn(3, C, 16, generator=gen), dim=-1)
    for kind in ("lower bound", "layer", "-0.1"):
        G = gate(kind, (3, C, 16), gen).cumsum(-2)
        got_a, got_b = decayed_scores((a, b), b, G, strict, lower_bound=BOUND)
        for got, left in ((got_a, a), (got_b, b)):
            want = exact_scores(left, b, G, strict)
            assert torch.isfinite(got).all(), f"C={C} g={kind}: non-finite scores"
            error = ((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()  # C = 1: A_kk = 0
            assert error < 1e-5, f"C={C} g={kind} strict={strict}: error {error:.1e} relative to the largest entry"
            size = exact_scores(left.abs(), b.abs(), G, strict)  # Σ_d |a_rd b_id| e^{G_rd − G_id}: each entry's scale
            seen = size > 1e-10  # also the small weights far below the diagonal, down to e^-23 (the floor is e^-30)
            relative = ((got.double() - want).abs()[seen] / size[seen]).max().item() if seen.any() else 0.0
            assert relative < 1e-5, f"C={C} g={kind}: an entry is off by {relative:.1e} of its own scale"


def test_bounded_sub_chunk_keeps_every_factor_in_float32_range():
    """The sub-chunk shrinks as the bound grows, (S − 1)·|L| ≤ 75; steeper bounds stay exact."""
    from k3course.ops.chunk import _bounded_sub_chunk

    assert _bounded_sub_chunk(-5.0, 64) == 16 and _bounded_sub_chunk(-5.0, 10) == 10
    assert _bounded_sub_chunk(-10.0, 64) == 8 and _bounded_sub_chunk(-30.0, 64) == 2
    assert _bounded_sub_chunk(-100.0, 64) == 1
    q, k, v, _, beta, s0 = inputs("uniform", scalar_gate=False, T=130)
    for bound in (-10.0, -30.0, -100.0):
        g = torch.full_like(q, bound)
        o, s = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, lower_bound=bound)
        o_rec, s_rec = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        assert_all_close([o, s], [o_rec, s_rec], f"g = lower_bound = {bound}")


@pytest.mark.parametrize("T", [1, 7, 64, 65, 130])
def test_bounded_path_at_edge_lengths_against_recurrent_and_fla(T):
    """T = 1, T < C, T = C, T = C + 1 and T not a multiple of C, initial and final state, at the bound."""
    tensors = inputs("layer", scalar_gate=False, T=T)
    q, k, v, g, beta, s0 = tensors
    got = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, lower_bound=BOUND)
    want = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert_all_close(list(got), list(want), f"T={T} vs recurrent")
    naive = pytest.importorskip("fla.ops.kda.naive")
    assert_all_close(list(got), list(naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0.clone(),
                                                               output_final_state=True)), f"T={T} vs fla")


@pytest.mark.parametrize("lower_bound", [None, BOUND])
def test_groups_of_chunks_pass_the_state_on(monkeypatch, lower_bound):
    """One chunk per head per group and one group for everything give the same outputs and state."""
    from k3course.ops import chunk

    tensors = inputs("layer", scalar_gate=False, T=150)
    runs = []
    for per_group in (1, 1000):
        monkeypatch.setattr(chunk, "GROUP_SCORES", per_group * 16 * 16)
        runs.append(outputs_and_gradients(kda_chunk, tensors, chunk_size=16, lower_bound=lower_bound))
    assert_all_close(runs[0], runs[1], f"groups of 1 vs 1000 chunks, lower_bound={lower_bound}")
    assert_all_close(runs[0], outputs_and_gradients(kda_recurrent, tensors), "groups of 1 chunk vs recurrent")


def test_lower_bound_is_checked_and_enforced():
    from k3course import debug

    q, k, v, g, beta, s0 = inputs("layer", scalar_gate=False, T=40)
    for bad in (0, 1.0, "x", float("nan"), -float("inf"), True):
        with pytest.raises(ValueError, match="lower_bound must be None or a negative finite number"):
            kda_chunk(q, k, v, g, beta, lower_bound=bad)
    steep = g - 3.0  # below the bound in places
    o, _ = kda_chunk(q, k, v, steep, beta, lower_bound=BOUND)  # no host read: clamped at the bound, finite
    o_clamped, _ = kda_recurrent(q, k, v, steep.clamp(min=BOUND), beta)
    assert_all_close([o], [o_clamped], "a gate below the bound is clamped to it")
    with debug.value_checks(), pytest.raises(ValueError, match="g has values below lower_bound"):
        kda_chunk(q, k, v, steep, beta, lower_bound=BOUND)


def test_bounded_path_in_bf16_and_fp64():
    """fp64 inputs: o and the state in fp64, equal to the fp32 run; bf16: o in bf16 close to the fp32 run on the
    same values, the state in fp32."""
    q, k, v, g, beta, s0 = inputs("layer", scalar_gate=False, T=70)
    o_32, s_32 = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, lower_bound=BOUND)
    o_64, s_64 = kda_chunk(*(x.double() for x in (q, k, v, g, beta)), initial_state=s0, output_final_state=True,
                           lower_bound=BOUND)
    assert o_64.dtype == s_64.dtype == torch.float64
    assert_all_close([o_64, s_64], [o_32, s_32], "fp64 inputs")
    halves = [x.bfloat16() for x in (q, k, v, g, beta)]
    o_16, s_16 = kda_chunk(*halves, initial_state=s0, output_final_state=True, lower_bound=BOUND)
    o_ref, s_ref = kda_recurrent(*(x.float() for x in halves), initial_state=s0, output_final_state=True)
    assert o_16.dtype == torch.bfloat16 and s_16.dtype == torch.float32
    assert ((o_16.float() - o_ref).norm() / o_ref.norm()).item() < 1e-2
    assert ((s_16 - s_ref).norm() / s_ref.norm()).item() < 1e-4


# --- the bounded path's hand-written backward (chunk._BoundedKDAChunks) ----------------------------------------

def gradients_through(op, tensors, with_initial: bool, with_final: bool, **options):
    """``[dq, dk, dv, dg, dbeta]`` (+ ``dinitial_state``) of a fixed random weighting of o (+ the final state;
    without it, the op is not asked for the final state)."""
    leaves = [x.clone().requires_grad_() for x in tensors[:5 + with_initial]]
    o, final = op(*leaves[:5], initial_state=leaves[5] if with_initial else None, output_final_state=with_final,
                  **options)
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    if with_final:
        loss = loss + (final * torch.randn(final.shape, generator=gen, dtype=final.dtype)).sum()
    loss.backward()
    return [x.grad for x in leaves]


def assert_gradients_close(got, want, tolerance: float, label: str) -> None:
    assert len(got) == len(want), label
    for name, x, y in zip((f"d{n}" for n in NAMES), got, want):
        assert x is not None and torch.isfinite(x).all(), f"{label}: {name} has NaN/inf or is missing"
        error = ((x - y).norm() / y.norm().clamp(min=1e-30)).item()
        assert error <= tolerance, f"{label}: {name} relative error {error:.2e} > {tolerance:g}"


BACKWARD_CASES = {  # name: (T, chunk_size, gate kind, initial state, final state's gradient)
    "T a multiple of C": (64, 32, "layer", True, True),
    "T not a multiple (padding)": (100, 16, "uniform", True, True),
    "T < one chunk": (7, 16, "layer", True, False),
    "T = 1": (1, 32, "layer", True, True),
    "C = 64, no initial state": (130, 64, "layer", False, True),
    "g = -5 everywhere": (70, 32, "lower bound", True, True),
    "only o is used": (90, 32, "-3", True, False),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_bounded_backward_equals_autograd_through_the_recurrence(case, dtype):
    """Every input gradient of the bounded path (its backward written out) against autograd through the
    recurrent op: to fp64 rounding in fp64, to 1e-4 in fp32; without an initial state or the final state's
    gradient too."""
    T, chunk_size, kind, with_initial, with_final = BACKWARD_CASES[case]
    tensors = [x.to(dtype) for x in inputs(kind, scalar_gate=False, T=T, H=3, K=16, V=8, seed=T)]
    got = gradients_through(kda_chunk, tensors, with_initial, with_final, chunk_size=chunk_size, lower_bound=BOUND)
    want = gradients_through(kda_recurrent, tensors, with_initial, with_final)
    assert_gradients_close(got, want, 1e-9 if dtype == torch.float64 else TOLERANCE, case)


def test_bounded_backward_with_a_gate_below_the_bound_beta_zero_and_many_groups(monkeypatch):
    """g below the bound is clamped: its gradient is zero there and equals the recurrence's on the clamped gate
    elsewhere; β = 0 (no delta update) and groups of 2 chunks (the state's gradient passed between groups)."""
    from k3course.ops import chunk

    monkeypatch.setattr(chunk, "GROUP_SCORES", 2 * 3 * 16 * 16)  # 3 heads: 2 chunks of each per group
    q, k, v, g, beta, s0 = inputs("layer", scalar_gate=False, T=150, H=3, seed=3)
    steep = g - 2.0 * (torch.arange(150) % 3 == 0).view(1, -1, 1, 1)  # every third token below the bound
    assert (steep < BOUND).any()
    for gates, betas in ((steep, beta), (g, torch.zeros_like(beta))):
        tensors = (q, k, v, gates, betas, s0)
        got = gradients_through(kda_chunk, tensors, True, True, chunk_size=16, lower_bound=BOUND)
        clamped = lambda q, k, v, g, *rest, **options: kda_recurrent(q, k, v, g.clamp(min=BOUND), *rest, **options)
        want = gradients_through(clamped, tensors, True, True)
        assert_gradients_close(got, want, TOLERANCE, "below the bound" if betas is beta else "beta = 0")
        assert (got[3][gates < BOUND] == 0).all()


def test_bounded_backward_called_under_autocast_computes_in_fp32():
    """Forward and backward inside a bf16 autocast region: the same gradients as without it (the op keeps its
    products in float32, its backward too)."""
    tensors = inputs("layer", scalar_gate=False, T=70, seed=4)
    want = gradients_through(kda_chunk, tensors, True, True, chunk_size=32, lower_bound=BOUND)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gradients_through(kda_chunk, tensors, True, True, chunk_size=32, lower_bound=BOUND)
    assert_gradients_close(got, want, 1e-6, "under autocast")


def test_bounded_path_gives_the_same_outputs_with_and_without_a_gradient():
    """Without a gradient the bounded path runs the plain forward (no tensors kept for a backward), with one the
    hand-written autograd function: the same outputs to fp32 rounding."""
    tensors = inputs("layer", scalar_gate=False, T=100, seed=6)
    with torch.no_grad():
        plain = kda_chunk(*tensors[:5], initial_state=tensors[5], output_final_state=True, chunk_size=32,
                          lower_bound=BOUND)
    leaves = [x.clone().requires_grad_() for x in tensors]
    by_hand = kda_chunk(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=32,
                        lower_bound=BOUND)
    assert type(by_hand[0].grad_fn).__name__ != "NoneType" and plain[0].grad_fn is None
    assert_all_close([x.detach() for x in by_hand], list(plain), "with vs without a gradient")


def test_bounded_backward_passes_gradcheck_in_fp64():
    """Finite differences in fp64, two chunks of 8 and a padded third, g inside (−5, 0) (at the bound the clamp
    has a kink)."""
    leaves = [x.double().requires_grad_() for x in inputs("layer", scalar_gate=False, T=19, H=1, K=4, V=3, seed=5)]
    with torch.no_grad():
        leaves[3].clamp_(BOUND + 0.1, -0.1)
    op = lambda *xs: kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=8,
                               lower_bound=BOUND)
    assert torch.autograd.gradcheck(op, leaves)


def test_bounded_path_backward_is_one_node_per_group():
    """The bounded path's autograd graph holds one hand-written node per group of chunks, not the hundreds of
    small ops of autograd through the forward (the unbounded path keeps those)."""

    def nodes(**options):
        leaves = [x.requires_grad_() for x in inputs("layer", scalar_gate=False, T=100)]
        o, final = kda_chunk(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=16,
                             **options)
        seen, todo = set(), [o.grad_fn, final.grad_fn]
        while todo:
            node = todo.pop()
            if node is not None and node not in seen:
                seen.add(node)
                todo.extend(next_node for next_node, _ in node.next_functions)
        return [type(node).__name__ for node in seen]

    bounded = nodes(lower_bound=BOUND)
    assert bounded.count("_BoundedKDAChunksBackward") == 1 and len(bounded) < 60, sorted(bounded)
    assert len(nodes()) > 200
