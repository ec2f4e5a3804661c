"""The KDA / GDN / GLA ops: NumPy fp64 ≈ torch recurrent ≈ torch chunked, states, gradients, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3course import debug
from k3course.ops import gdn_chunk, gdn_recurrent, gla_chunk, gla_recurrent, kda_chunk, kda_recurrent
from k3course.ops.chunk import decayed_scores, factored_scores, kda_chunk_step, ut_transform
from k3course.reference import linear_attention as ref

RTOL = 1e-4


def inputs(T, seed=0, B=2, H=2, K=8, V=6, g_low=-2.0, scalar_gate=False, dtype=torch.float32):
    """Seeded q, k (L2-normalised), v, g ≤ 0, beta ∈ (0, 1), initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g_shape = (B, T, H) if scalar_gate else (B, T, H, K)
    g = g_low * torch.rand(*g_shape, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta, state)]


def _numpy(x):
    return x.detach().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


def assert_close(got, want, rtol=RTOL, what="output"):
    got, want = _numpy(got), _numpy(want)
    assert np.isfinite(got).all(), f"{what}: not finite"
    scale = np.abs(want).max() + 1e-12
    err = np.abs(got - want).max() / scale
    assert err <= rtol, f"{what}: max error {err:.3g} relative to max |value| (rtol {rtol:g})"


def numpy_all(*xs):
    return [x.double().numpy() for x in xs]


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
def test_kda_numpy_recurrent_chunked_agree_with_states(T):
    q, k, v, g, beta, s0 = inputs(T, seed=T)
    o_np, s_np = ref.kda(*numpy_all(q, k, v, g, beta), initial_state=s0.double().numpy())
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert_close(o_rec, o_np, 1e-5, "recurrent o"), assert_close(s_rec, s_np, 1e-5, "recurrent state")
    for chunk_size in (16, 32, 64):
        o_ch, s_ch = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
        assert_close(o_ch, o_np, RTOL, f"chunk {chunk_size} o")
        assert_close(s_ch, s_np, RTOL, f"chunk {chunk_size} state")


@pytest.mark.parametrize("T", [1, 65, 200])
def test_gdn_numpy_recurrent_chunked_agree(T):
    q, k, v, g, beta, s0 = inputs(T, seed=10 + T, scalar_gate=True)
    o_np, s_np = ref.gated_delta_rule(*numpy_all(q, k, v, g, beta), initial_state=s0.double().numpy())
    o_rec, s_rec = gdn_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert_close(o_rec, o_np, 1e-5), assert_close(s_rec, s_np, 1e-5)
    for chunk_size in (16, 64):
        o_ch, s_ch = gdn_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
        assert_close(o_ch, o_np), assert_close(s_ch, s_np)


def test_gdn_is_kda_with_a_channel_constant_gate():
    q, k, v, g, beta, s0 = inputs(70, seed=3, scalar_gate=True)
    g_channel = g.unsqueeze(-1).expand(*g.shape, q.shape[-1]).contiguous()
    for gdn, kda in ((gdn_recurrent, kda_recurrent), (gdn_chunk, kda_chunk)):
        o_g, s_g = gdn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        o_k, s_k = kda(q, k, v, g_channel, beta, initial_state=s0, output_final_state=True)
        assert_close(o_g, o_k, 1e-6), assert_close(s_g, s_k, 1e-6)


def test_deltanet_is_g_zero_and_linear_attention_is_gla_g_zero():
    q, k, v, g, beta, s0 = inputs(40, seed=4)
    zero = torch.zeros_like(g)
    o_np, s_np = ref.delta_rule(*numpy_all(q, k, v, beta), initial_state=s0.double().numpy())
    o_ch, s_ch = kda_chunk(q, k, v, zero, beta, initial_state=s0, output_final_state=True, chunk_size=16)
    assert_close(o_ch, o_np), assert_close(s_ch, s_np)
    o_np, s_np = ref.linear_attention(*numpy_all(q, k, v), initial_state=s0.double().numpy())
    o_ch, s_ch = gla_chunk(q, k, v, zero, initial_state=s0, output_final_state=True, chunk_size=16)
    assert_close(o_ch, o_np), assert_close(s_ch, s_np)


@pytest.mark.parametrize("scalar_gate", [False, True])
def test_gla_numpy_recurrent_chunked_parallel_agree(scalar_gate):
    q, k, v, g, _, s0 = inputs(50, seed=5, scalar_gate=scalar_gate)
    o_np, s_np = ref.decay_linear_attention(*numpy_all(q, k, v, g), initial_state=s0.double().numpy())
    o_rec, s_rec = gla_recurrent(q, k, v, g, initial_state=s0, output_final_state=True)
    o_ch, s_ch = gla_chunk(q, k, v, g, initial_state=s0, output_final_state=True, chunk_size=16)
    assert_close(o_rec, o_np, 1e-5), assert_close(s_rec, s_np, 1e-5)
    assert_close(o_ch, o_np), assert_close(s_ch, s_np)
    o_parallel = ref.decay_attention_parallel(*numpy_all(q, k, v, g))
    o_zero, _ = gla_recurrent(q, k, v, g)
    assert_close(o_zero, o_parallel, 1e-5, "parallel form")


def test_strong_decay_at_the_lower_bound_is_finite_and_correct():
    q, k, v, g, beta, s0 = inputs(130, seed=6)
    g = torch.full_like(g, -5.0)
    o_np, s_np = ref.kda(*numpy_all(q, k, v, g, beta), initial_state=s0.double().numpy())
    o_ch, s_ch = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=64)
    assert_close(o_ch, o_np), assert_close(s_ch, s_np)
    G = g[0, :64, 0].cumsum(0)  # one chunk, one head: e^{-G} reaches e^{320}
    naive = factored_scores(q[0, :64, 0], k[0, :64, 0], G)
    assert not torch.isfinite(naive).all(), "the factored form should overflow here (that is the lesson)"
    assert torch.isfinite(decayed_scores(q[0, :64, 0], k[0, :64, 0], G, strict=False)).all()


def test_no_initial_state_and_no_final_state():
    q, k, v, g, beta, _ = inputs(20, seed=7)
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta)
    o_ch, s_ch = kda_chunk(q, k, v, g, beta, chunk_size=16)
    assert s_rec is None and s_ch is None
    assert_close(o_ch, o_rec)


def test_state_continues_the_sequence():
    q, k, v, g, beta, s0 = inputs(90, seed=8)
    o_full, s_full = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=32)
    o_a, s_a = kda_chunk(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], initial_state=s0,
                         output_final_state=True, chunk_size=32)
    o_b, s_b = kda_chunk(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], initial_state=s_a,
                         output_final_state=True, chunk_size=32)
    assert_close(torch.cat([o_a, o_b], 1), o_full), assert_close(s_b, s_full)


def test_low_precision_inputs_return_their_dtype():
    q, k, v, g, beta, s0 = inputs(33, seed=9, dtype=torch.bfloat16)
    o_ch, s_ch = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=16)
    o_rec, _ = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    assert o_ch.dtype == torch.bfloat16 and s_ch.dtype == torch.float32
    assert_close(o_ch.float(), o_rec.float(), 2e-2)


@pytest.mark.parametrize("op", [kda_chunk, kda_recurrent])
def test_under_autocast_the_recurrence_and_its_state_stay_fp32(op):
    """Mixed precision (k3course train --dtype bfloat16): bf16 q, k, v with the gates in fp32 (as autocast makes
    them) give the numbers the op gives without autocast: the products and the state are fp32 inside."""
    q, k, v, g, beta, s0 = inputs(40, seed=5)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    plain = op(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = op(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert mixed[0].dtype == torch.bfloat16 and mixed[1].dtype == torch.float32
    assert torch.equal(mixed[0], plain[0]) and torch.equal(mixed[1], plain[1])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_fp64_inputs_are_computed_in_fp64(lower_bound):
    """fp64 stays fp64 (a reference dtype, and what gradcheck needs): the ops agree with NumPy to fp64 rounding."""
    q, k, v, g, beta, s0 = inputs(70, seed=21, dtype=torch.float64)
    o_np, s_np = ref.kda(*numpy_all(q, k, v, g, beta), initial_state=s0.numpy())
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_ch, s_ch = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=16,
                           lower_bound=lower_bound)
    for got in (o_rec, s_rec, o_ch, s_ch):
        assert got.dtype == torch.float64
    for what, got, want in [("recurrent o", o_rec, o_np), ("recurrent state", s_rec, s_np),
                            ("chunk o", o_ch, o_np), ("chunk state", s_ch, s_np)]:
        assert_close(got, want, 1e-12, what)


def test_kda_chunk_passes_gradcheck_in_fp64():
    leaves = [x.requires_grad_(True) for x in inputs(19, seed=22, B=1, H=1, K=4, V=3, dtype=torch.float64)]
    op = lambda *xs: kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=8)
    assert torch.autograd.gradcheck(op, leaves)


def test_gradients_of_chunked_and_recurrent_agree():
    tensors = inputs(45, seed=11, B=1)
    leaves = [x.clone().requires_grad_(True) for x in tensors]
    weight = torch.randn(1, 45, 2, 6, generator=torch.Generator().manual_seed(1))

    def grads(op, **kwargs):
        for x in leaves:
            x.grad = None
        o, s = op(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kwargs)
        ((o * weight).sum() + s.square().sum()).backward()
        return [x.grad.clone() for x in leaves]

    for name, g_rec, g_ch in zip("q k v g beta state".split(), grads(kda_recurrent), grads(kda_chunk, chunk_size=16)):
        assert_close(g_ch, g_rec, 1e-4, f"d/d{name}")


def test_single_chunk_step_matches_recurrence_and_ut_is_the_inverse():
    q, k, v, g, beta, s0 = inputs(16, seed=12)
    scale = q.shape[-1] ** -0.5
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    heads_first = [x.transpose(1, 2) for x in (q * scale, k, v, g, beta)]  # [B, H, C, ...]
    o_step, s_step = kda_chunk_step(*heads_first, s0)
    assert_close(o_step.transpose(1, 2), o_rec), assert_close(s_step, s_rec)
    A = torch.randn(3, 24, 24, generator=torch.Generator().manual_seed(2)).tril(-1) * 0.3
    b = torch.rand(3, 24, generator=torch.Generator().manual_seed(3))
    assert_close(ut_transform(A, b), torch.linalg.inv(torch.eye(24) + A) * b[:, None, :], 1e-5)


def test_padding_does_not_leak_into_outputs():
    q, k, v, g, beta, _ = inputs(70, seed=13)
    o, _ = kda_chunk(q, k, v, g, beta, chunk_size=64)
    o_prefix, _ = kda_chunk(q[:, :65], k[:, :65], v[:, :65], g[:, :65], beta[:, :65], chunk_size=64)
    assert_close(o_prefix, o[:, :65])


# --- bad input ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", [kda_recurrent, kda_chunk])
def test_bad_inputs_get_clear_errors(op):
    q, k, v, g, beta, s0 = inputs(10, seed=14)
    with pytest.raises(ValueError, match="k must have the shape of q"):
        op(q, k[:, :9], v, g, beta)
    with pytest.raises(ValueError, match=r"g must be \[B, T, H, K\]"):
        op(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match=r"beta must be \[B, T, H\]"):
        op(q, k, v, g, beta.transpose(1, 2))  # heads-first layout
    with pytest.raises(ValueError, match=r"v must be \[B, T, H, V\]"):
        op(q, k, v.transpose(1, 2), g, beta)
    with pytest.raises(TypeError, match="v has dtype torch.float64"):
        op(q, k, v.double(), g, beta)
    with pytest.raises(ValueError, match=r"initial_state must be \[B, H, K, V\]"):
        op(q, k, v, g, beta, initial_state=s0[:, :1])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        op(q.numpy(), k, v, g, beta)


@pytest.mark.parametrize("op", [kda_recurrent, kda_chunk])
def test_bad_values_get_clear_errors_under_the_debug_switch(op):
    q, k, v, g, beta, _ = inputs(10, seed=14)
    op(q, k, v, g.abs() + 0.1, beta)  # value checks are off in the hot path: no host read, no error
    with debug.value_checks():
        with pytest.raises(ValueError, match="g is the log-decay"):
            op(q, k, v, g.abs() + 0.1, beta)
        with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
            op(q, k, v, g, beta + 1.5)
        op(q, k, v, g, beta * 2, allow_neg_eigval=True)  # β ∈ [0, 2] is allowed when asked for
        with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\]"):
            op(q, k, v, g, beta + 2.5, allow_neg_eigval=True)
        with pytest.raises(ValueError, match="q contains NaN"):
            op(q.masked_fill(q > 2, float("nan")), k, v, g, beta)


def test_non_contiguous_inputs_are_accepted():
    q, k, v, g, beta, _ = inputs(30, seed=15)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_strided.is_contiguous()
    assert_close(kda_chunk(q_strided, k, v, g, beta, chunk_size=16)[0], kda_recurrent(q, k, v, g, beta)[0])


def test_gdn_and_chunk_size_errors():
    q, k, v, g, beta, _ = inputs(10, seed=16, scalar_gate=True)
    with pytest.raises(ValueError, match=r"g must be \[B, T, H\]"):
        gdn_chunk(q, k, v, g.unsqueeze(-1).expand(*g.shape, 8), beta)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        gdn_chunk(q, k, v, g, beta, chunk_size=0)


def test_both_score_paths_are_exact_and_unbounded_gates_work():
    q, k, v, g, beta, s0 = inputs(100, seed=17, g_low=-30.0)  # Kimi Linear's unbounded gate: sub-chunk spans > 60
    o_np, s_np = ref.kda(*numpy_all(q, k, v, g, beta), initial_state=s0.double().numpy())
    o_ch, s_ch = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=32)
    assert_close(o_ch, o_np), assert_close(s_ch, s_np)
    a, b = q[0, :32, 0], k[0, :32, 0]
    for G in (g[0, :32, 0].cumsum(0), g[0, :32, 0].cumsum(0) / 20):  # steep, then mild decay
        G64 = G.double().numpy()
        exact = np.tril(np.einsum("rd,id,rid->ri", a.double().numpy(), b.double().numpy(),
                                  np.exp(np.minimum(G64[:, None] - G64[None], 0))))
        assert_close(decayed_scores(a, b, G, strict=False), exact, 1e-5, "decayed scores")


def test_bench_kda_runs_and_reports_its_ratios(capsys):
    from k3course.bench.kda import chunk_flops, kda_inputs, main

    assert main(["--lengths", "32", "64", "--recurrent-length", "32", "--heads", "1", "--dim", "8", "--repeats", "1",
                 "--rounds", "1", "--chunk-size", "16", "--return-freed-memory"]) == 0  # leave pytest's allocator
    report = capsys.readouterr().out
    for row in ("chunked, K3 gates, lower_bound=-5", "K3 layer's gates at init", "mild gates", "no bound",
                "package recurrent (kda_recurrent)", "chunked growth T=32 -> 64 (2x longer)"):
        assert row in report, f"the report lacks the row {row!r}"
    assert "x the chunked path" in report and "of matmul rate" in report and "H·(6T·d² + 3T·C·d + T·C²)" in report
    assert report.count(">= 10x: ") >= 1 and ">= 20%: " in report and "<= 9x: " in report  # each target, judged
    assert chunk_flops(64, 64, 64) == 10 * 64 * 64 * 64  # 6Td² + 3TCd + TC² with C = d
    assert torch.is_grad_enabled(), "the benchmark must not switch autograd off for its caller"
    g = kda_inputs(4096, gates="layer")[3]  # K3's bounded gate over its whole range, down to the bound
    assert -5.0 < g.min() < -4.9 and -0.1 < g.max() < 0 and abs(g.mean() + 2.5) < 0.05
    g_init = kda_inputs(512, heads=2, dim=16, gates="init")[3]  # a freshly initialised layer's own gates
    assert g_init.shape == (1, 512, 2, 16) and -5.0 < g_init.min() and g_init.max() < 0


def test_chunked_ops_on_zero_tokens_return_an_empty_output_and_the_initial_state():
    from k3course.ops.chunk import gdn_chunk, gla_chunk, kda_chunk

    B, H, K, V = 2, 3, 8, 5
    q, k, g = (torch.zeros(B, 0, H, K) for _ in range(3))
    v, beta, state = torch.zeros(B, 0, H, V), torch.zeros(B, 0, H), torch.randn(B, H, K, V)
    outputs = {"kda": kda_chunk(q, k, v, g, beta, initial_state=state, output_final_state=True, lower_bound=-5.0),
               "gdn": gdn_chunk(q, k, v, g[..., 0], beta, initial_state=state, output_final_state=True),
               "gla": gla_chunk(q, k, v, g, initial_state=state, output_final_state=True)}
    for name, (o, final) in outputs.items():
        assert o.shape == (B, 0, H, V), name
        assert torch.equal(final, state), f"{name}: no token, so the state must pass through unchanged"


@pytest.mark.parametrize("layer_class", ["KimiDeltaAttention", "GatedDeltaNet", "DecayedLinearAttention"])
def test_a_layer_runs_under_bf16_autocast_close_to_fp32(layer_class):
    """k3course train --dtype bfloat16: the fused projection and short convolution keep one dtype (the conv weight
    is cast like conv1d would), so the op gets bf16 q, k, v and the output is near the fp32 layer's."""
    from k3course.layers import kda as kda_layers

    torch.manual_seed(0)
    layer = getattr(kda_layers, layer_class)(32, 2, 16).train()
    x = torch.randn(2, 40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, cache = layer(x)
    want, _ = layer(x)
    assert y.dtype == torch.bfloat16 and cache.state.dtype == torch.float32
    assert (y.float() - want).norm() / want.norm() < 2e-2
