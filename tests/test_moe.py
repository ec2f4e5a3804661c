"""The MoE torch rung and layers agree with the NumPy reference (fp64 vs fp32, ≤ 1e-5 relative)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3course import debug
from k3course.moe import (
    LatentMoE,
    MoE,
    all_to_all_bytes_per_token,
    grouped_mm,
    latent_combine,
    moe_flops_per_token,
    rms_norm,
    router_scores,
    sort_by_expert,
    topk_route,
    unsort,
)
from k3course.moe.experts import situ_glu, swiglu
from k3course.moe.routing import topk_indices
from k3course.reference import moe as ref

RTOL = 1e-5


def assert_close(got: torch.Tensor, want: np.ndarray, rtol: float = RTOL) -> None:
    got = got.detach().double().numpy()
    scale = max(np.abs(want).max(), 1e-12)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= rtol * scale, f"max err {np.abs(got - want).max():.3g} vs scale {scale:.3g}"


def seeded_scores(m: int, n: int, seed: int, router_score: str = "sigmoid") -> torch.Tensor:
    logits = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))
    return router_scores(logits, router_score)


ROUTE_CASES = {
    "k=1": dict(m=37, n=8, k=1),
    "k=n-1": dict(m=37, n=8, k=7),
    "k=n": dict(m=37, n=8, k=8),
    "m=1": dict(m=1, n=5, k=2),
    "softmax, no renormalize": dict(m=33, n=16, k=4, router_score="softmax", renormalize=False),
    "with bias": dict(m=41, n=16, k=3, bias=True),
}


@pytest.mark.parametrize("name", ROUTE_CASES)
def test_topk_route_matches_reference(name):
    case = dict(ROUTE_CASES[name])
    m, n, k = case.pop("m"), case.pop("n"), case.pop("k")
    scores = seeded_scores(m, n, seed=1, router_score=case.pop("router_score", "sigmoid"))
    bias = 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(2)) if case.pop("bias", False) else None
    renormalize = case.pop("renormalize", True)
    idx, weights = topk_route(scores, k, bias, renormalize)
    ref_idx, ref_weights = ref.topk_route(scores.double().numpy(), k, None if bias is None else bias.double().numpy(),
                                          renormalize)
    assert idx.dtype == torch.int64 and (idx.numpy() == ref_idx).all()
    assert_close(weights, ref_weights)


def test_ties_go_to_the_lower_index():
    scores = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.2, 0.7, 0.7, 0.1]])
    idx, weights = topk_route(scores, 2)
    assert idx.tolist() == [[0, 1], [1, 2]]
    assert (ref.topk_route(scores.double().numpy(), 2)[0] == idx.numpy()).all()
    assert torch.allclose(weights, torch.full((2, 2), 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_topk_indices_is_a_stable_descending_sort_for_negative_tied_and_signed_zero_values(dtype):
    coarse = (4 * torch.randn(50, 12, generator=torch.Generator().manual_seed(20))).round() / 4  # many ties
    special = torch.tensor([[0.0, -0.0, -1.0, float("inf"), -0.0, 0.0, float("-inf"), -1.0] + [0.5] * 4])
    for values in (coarse.to(dtype), special.to(dtype)):
        for k in (1, 5, 12):
            want = torch.sort(values.double(), dim=1, descending=True, stable=True).indices[:, :k]
            assert torch.equal(topk_indices(values, k), want)


def test_bias_steers_selection_but_not_weights():
    scores = seeded_scores(50, 8, seed=3)
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 is always chosen
    idx, weights = topk_route(scores, 2, bias)
    assert (idx[:, 0] == 5).all()
    chosen = scores.gather(1, idx)
    assert torch.allclose(weights, chosen / chosen.sum(1, keepdim=True))


def test_gradient_reaches_scores_through_chosen_weights_only_and_never_the_bias():
    scores = seeded_scores(20, 6, seed=4).requires_grad_()
    bias = (0.5 * torch.randn(6, generator=torch.Generator().manual_seed(5))).requires_grad_()
    idx, weights = topk_route(scores, 2, bias)
    loss = (weights * torch.arange(1.0, 3.0)).sum()
    grad_scores, grad_bias = torch.autograd.grad(loss, (scores, bias), allow_unused=True)
    assert grad_bias is None
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
    assert (grad_scores[~chosen] == 0).all() and (grad_scores[chosen] != 0).all()


# --- dispatch --------------------------------------------------------------------------------------------

def test_sort_by_expert_groups_slots_and_unsort_inverts():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 2]])
    order, offsets = sort_by_expert(idx, 5)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [2, 3, 7, 8, 8]
    assert idx.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 2, 2, 3]
    assert order.tolist() == [1, 4, 3, 0, 2, 5, 7, 6]  # stable: slots stay in token order within an expert
    rows = torch.arange(8.0)[:, None]
    assert torch.equal(unsort(rows[order], order), rows)


@pytest.mark.parametrize("impl", ["loop", "torch", "auto"])
def test_grouped_mm_matches_per_row_products(impl):
    if impl == "torch" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    generator = torch.Generator().manual_seed(6)
    x, weight = torch.randn(13, 8, generator=generator), torch.randn(4, 8, 4, generator=generator)
    offsets = torch.tensor([3, 3, 10, 13], dtype=torch.int32)  # expert 1 is empty
    owner = torch.repeat_interleave(torch.arange(4), torch.diff(offsets, prepend=torch.zeros(1, dtype=torch.int32)))
    want = torch.einsum("md,mde->me", x, weight[owner])
    assert torch.allclose(grouped_mm(x, weight, offsets, impl), want, atol=1e-5)


def test_a_compiled_graph_never_launches_the_triton_grouped_gemm(monkeypatch):
    """Where the Triton kernel would run eagerly, a graph being traced by torch.compile takes torch's grouped GEMM
    or the loop operator: the kernel's grid depends on the block sizes (dynamo failed on it on an H200)."""
    import k3course.kernels
    from k3course.moe.dispatch import grouped_mm_path

    monkeypatch.setattr(k3course.kernels, "use_triton", lambda device, backend: True)
    x, weight = torch.randn(4, 8), torch.randn(2, 8, 4)
    assert grouped_mm_path(x, weight) == "triton"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert grouped_mm_path(x, weight) == "loop"  # fp32 on a CPU: no fast path for torch._grouped_mm


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_layer_with_torch_grouped_mm_matches_the_loop_forward_and_backward():
    grads = {}
    for impl in ("loop", "torch"):
        layer = LatentMoE(32, 8, 2, expert_dim=16, generator=torch.Generator().manual_seed(17), kernels=impl)
        y = layer(torch.randn(37, 32, generator=torch.Generator().manual_seed(18)))
        y.square().sum().backward()
        grads[impl] = (y.detach(), layer.experts.gate_up.grad, layer.experts.down.grad, layer.router.grad)
    for loop_tensor, torch_tensor in zip(grads["loop"], grads["torch"]):
        assert torch.allclose(loop_tensor, torch_tensor, rtol=1e-5, atol=1e-5)


def test_unsort_backward_gathers_the_gradient_in_sorted_order():
    order = torch.tensor([3, 0, 4, 1, 2])
    rows = torch.arange(10.0).view(5, 2).requires_grad_()
    grad = torch.randn(5, 2, generator=torch.Generator().manual_seed(30))
    unsort(rows, order).backward(grad)
    assert torch.equal(rows.grad, grad[order])


GROUPED_CASES = {
    "an empty expert": [3, 3, 10, 13],
    "every row in one expert": [0, 13, 13, 13],
    "one row per expert, odd sizes": [1, 2, 3, 13],
}


@pytest.mark.parametrize("name", GROUPED_CASES)
def test_grouped_mm_loop_gradients_match_per_row_products(name):
    generator = torch.Generator().manual_seed(31)
    offsets = torch.tensor(GROUPED_CASES[name], dtype=torch.int32)
    owner = torch.repeat_interleave(torch.arange(4), torch.diff(offsets, prepend=torch.zeros(1, dtype=torch.int32)))
    x, weight = torch.randn(13, 5, generator=generator), torch.randn(4, 5, 3, generator=generator)
    grad = torch.randn(13, 3, generator=generator)
    got, want = [], []
    for result, run in ((got, lambda x_, w_: grouped_mm(x_, w_, offsets, "loop")),
                        (want, lambda x_, w_: torch.einsum("md,mde->me", x_, w_[owner]))):
        x_, w_ = x.clone().requires_grad_(), weight.clone().requires_grad_()
        run(x_, w_).backward(grad)
        result += [x_.grad, w_.grad]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5)
    empty = offsets.diff(prepend=torch.zeros(1, dtype=torch.int32)) == 0
    assert (got[1][empty] == 0).all()  # experts with no rows get a zero gradient


# --- the layers against the reference loop ------------------------------------------------------------------

LAYER_CASES = {
    "latent, sigmoid, situ_glu, 2 shared": dict(latent=True, k=2, n_shared_experts=2, activation="situ_glu"),
    "latent, k=1": dict(latent=True, k=1),
    "latent, k=n-1": dict(latent=True, k=7),
    "latent, k=n": dict(latent=True, k=8),
    "plain, softmax, swiglu, 1 shared": dict(latent=False, k=3, n_shared_experts=1, router_score="softmax"),
    "plain, k=n-1, route_scale 2.5": dict(latent=False, k=7, route_scale=2.5),
    "one expert takes every token": dict(latent=True, k=1, hot_expert=3),
    "ties: zero router, all scores 0.5": dict(latent=True, k=3, zero_router=True),
}


@pytest.mark.parametrize("name", LAYER_CASES)
def test_layer_matches_reference_loop(name):
    case = dict(LAYER_CASES[name])
    latent, k = case.pop("latent"), case.pop("k")
    hot_expert, zero_router = case.pop("hot_expert", None), case.pop("zero_router", False)
    generator = torch.Generator().manual_seed(7)
    layer = MoE(32, 8, k, expert_dim=16, latent_dim=16 if latent else None, generator=generator, **case)
    with torch.no_grad():
        layer.latent_norm.copy_(1 + 0.1 * torch.randn(16, generator=generator)) if latent else None
        if hot_expert is not None:
            layer.bias[hot_expert] = 100.0
        if zero_router:
            layer.router.zero_()
    x = torch.randn(37, 32, generator=generator)  # 37: divisible by nothing here
    y = layer(x)
    want = ref.moe_forward(x.double().numpy(), layer.reference_params(), k, layer.routing.router_score,
                           case.get("activation", "swiglu"), layer.route_scale)
    assert_close(y, want)
    if hot_expert is not None:
        assert layer.load_statistics()["load"][hot_expert] == 37


GRADIENT_CASES = {
    "seeded, situ_glu": dict(m=37, k=2),
    "k=1": dict(m=37, k=1),
    "every token to one expert": dict(m=37, k=1, hot_expert=5),
    "one token, k=n": dict(m=1, k=8),
}


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_sort_based_gradients_match_the_per_token_loop(name):
    """The expert-by-expert path's backward (blocks split, weights unbound) against autograd through the
    per-token loop, which touches each token's experts one at a time: every weight, and the input."""
    from k3course.bench.moe import per_token_loop

    case = GRADIENT_CASES[name]
    generator = torch.Generator().manual_seed(32)
    layer = LatentMoE(24, 8, case["k"], expert_dim=12, latent_dim=10, activation="situ_glu", kernels="loop",
                      generator=generator)
    if "hot_expert" in case:
        with torch.no_grad():
            layer.bias[case["hot_expert"]] = 100.0
    x = torch.randn(case["m"], 24, generator=generator)
    grad = torch.randn(case["m"], 24, generator=generator)
    grads = []
    for forward in (layer, lambda x_: per_token_loop(layer, x_)):
        layer.zero_grad(set_to_none=True)
        x_ = x.clone().requires_grad_()
        forward(x_).backward(grad)
        grads.append([x_.grad] + [p.grad for p in layer.parameters()])
    for got, want in zip(*grads):  # fp32 sums in another order: to 1e-5 of the largest entry, whatever the threads
        assert torch.allclose(got, want, rtol=1e-4, atol=max(1e-6, 1e-5 * want.abs().max().item()))
    if "hot_expert" in case:  # the other experts saw no token: zero gradient, not a missing one
        others = [j for j in range(8) if j != case["hot_expert"]]
        assert (layer.experts.gate_up.grad[others] == 0).all() and layer.experts.gate_up.grad[5].abs().sum() > 0


def test_bf16_layer_follows_the_fp32_layer_and_keeps_its_dtype():
    """bf16 weights and tokens: bf16 outputs and gradients, within bf16 rounding of the fp32 layer (RMSNorm
    runs in fp32; the GEMMs accumulate in fp32 inside torch)."""
    def build():
        return LatentMoE(32, 8, 2, n_shared_experts=1, expert_dim=16, activation="situ_glu",
                         generator=torch.Generator().manual_seed(33))

    x = torch.randn(29, 32, generator=torch.Generator().manual_seed(34))
    want = build()(x)
    low = build().to(torch.bfloat16)
    x_low = x.to(torch.bfloat16).requires_grad_()
    got = low(x_low)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 0.05 * want.abs().max()
    got.float().square().sum().backward()
    assert x_low.grad.dtype == torch.bfloat16 and torch.isfinite(x_low.grad.float()).all()
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad.float()).all() for p in low.parameters())


def test_latent_moe_defaults_to_half_width_and_keeps_input_shape():
    layer = LatentMoE(64, 8, 2, n_shared_experts=1, generator=torch.Generator().manual_seed(8))
    assert layer.latent_dim == 32 and layer.down_proj.shape == (64, 32)
    x = torch.randn(2, 5, 64)
    assert layer(x).shape == (2, 5, 64)


def test_activations_match_reference():
    generator = torch.Generator().manual_seed(9)
    gate, up = 20 * torch.randn(100, generator=generator), 60 * torch.randn(100, generator=generator)
    assert_close(swiglu(gate, up), ref.swiglu(gate.double().numpy(), up.double().numpy()))
    assert_close(situ_glu(gate, up), ref.situ_glu(gate.double().numpy(), up.double().numpy()))
    assert situ_glu(gate, up).abs().max() < 4 * 25  # the caps hold



def _situ_by_autograd(gate, up, beta1=4.0, beta2=25.0):
    """SiTU-GLU as the plain expression, differentiated by autograd: what the written-out backward must equal."""
    return beta1 * torch.tanh(gate / beta1) * torch.sigmoid(gate) * (beta2 * torch.tanh(up / beta2))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0, 1e3])  # near 0, typical, both caps biting, saturated
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_situ_glu_backward_equals_autograd_through_the_expression(scale, dtype):
    generator = torch.Generator().manual_seed(11)
    gate, up, weight = (scale * torch.randn(3, 40, 24, generator=generator, dtype=torch.float64) for _ in range(3))
    runs = []
    for fn in (situ_glu, _situ_by_autograd):
        g, u = (x.to(dtype).requires_grad_() for x in (gate, up))
        y = fn(g, u, 3.0, 20.0)
        runs.append((y, *torch.autograd.grad((y * weight.to(dtype)).sum(), (g, u))))
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6  # of the largest entry
    for name, got, want in zip(("y", "d gate", "d up"), *runs):
        assert torch.isfinite(got).all(), name
        assert (got - want).abs().max() <= tolerance * want.abs().max(), name



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tanh_by_expm1_is_tanh_to_a_few_ulp_for_every_sign_and_size(dtype):
    from k3course.moe.experts import _tanh_by_expm1

    generator = torch.Generator().manual_seed(13)
    x = torch.cat([s * torch.randn(4000, generator=generator, dtype=torch.float64) for s in (1e-6, 1e-2, 1, 10, 1e4)])
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e-300, 80.0, -80.0, 1e300, -1e300])]).to(dtype)
    got, want = _tanh_by_expm1(x, 0.25).double(), torch.tanh(x.double() * 0.25)
    relative = ((got - want).abs() / want.abs().clamp_min(torch.finfo(dtype).tiny)).max()
    assert relative <= 4 * torch.finfo(dtype).eps, f"{dtype}: {relative:.2e}"
    special = _tanh_by_expm1(torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=dtype), 1.0)
    assert special[:2].tolist() == [1.0, -1.0] and special[2].isnan()

def test_situ_glu_gradcheck_and_its_limits():
    generator = torch.Generator().manual_seed(12)
    gate, up = (3 * torch.randn(6, 5, generator=generator, dtype=torch.float64) for _ in range(2))
    assert torch.autograd.gradcheck(situ_glu, (gate.requires_grad_(), up.requires_grad_()))
    with pytest.raises(RuntimeError):  # the backward is written out once: no silent zero second derivative
        (grad_gate,) = torch.autograd.grad(situ_glu(gate, up).sum(), gate, create_graph=True)
        torch.autograd.grad(grad_gate.sum(), gate)
    with pytest.raises(ValueError, match="gate and up"):
        situ_glu(torch.ones(4, 3), torch.ones(3))
    empty = torch.zeros(0, 8, requires_grad=True)
    situ_glu(empty, empty).sum().backward()
    assert empty.grad.shape == (0, 8)
    half = situ_glu(torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16())
    assert half.dtype == torch.bfloat16

def test_router_learns_through_weights_and_bias_gets_no_gradient():
    layer = LatentMoE(32, 8, 2, n_shared_experts=1, expert_dim=16, generator=torch.Generator().manual_seed(10))
    layer(torch.randn(40, 32, generator=torch.Generator().manual_seed(11))).square().sum().backward()
    assert "bias" not in dict(layer.named_parameters()) and not layer.bias.requires_grad and layer.bias.grad is None
    assert layer.router.grad is not None and layer.router.grad.abs().sum() > 0
    assert all(p.grad is not None for p in layer.parameters())


def test_renormalised_sigmoid_weights_with_k_equal_one_leave_the_router_without_gradient():
    # p = s / s = 1: the router has nothing to learn from when k = 1 and weights are renormalised
    generator = torch.Generator().manual_seed(12)
    layer = MoE(16, 4, 1, generator=generator)
    layer(torch.randn(10, 16, generator=generator)).sum().backward()
    assert layer.router.grad.abs().max() < 1e-6  # rounding of s / s only


def test_bias_updates_in_training_and_is_frozen_in_eval():
    generator = torch.Generator().manual_seed(13)
    layer = LatentMoE(32, 8, 2, generator=generator, balancing="quantile")
    x = torch.randn(64, 32, generator=generator)
    layer.eval()
    layer(x)
    assert layer.update_bias() is False and torch.equal(layer.bias, torch.zeros(8))
    layer.train()
    layer(x)
    assert layer.load_statistics()["load"].sum() == 64 * 2
    assert layer.update_bias() is True and layer.bias.abs().sum() > 0
    assert layer.update_bias() is False  # the same batch is not applied twice
    with pytest.raises(RuntimeError, match="since the last update_bias"):
        layer.load_statistics()  # the record was used and cleared
    assert abs(float(layer.bias.mean())) < 1e-6
    frozen = layer.bias.clone()
    layer.eval()
    layer(x)
    assert layer.update_bias() is False and torch.equal(layer.bias, frozen)


@pytest.mark.parametrize("balancing", ["sign", "aux_loss", "none"])
def test_other_balancing_modes(balancing):
    generator = torch.Generator().manual_seed(14)
    layer = MoE(16, 4, 2, generator=generator, balancing=balancing, gamma=0.01)
    layer(torch.randn(30, 16, generator=generator))
    assert layer.z_loss.requires_grad and float(layer.z_loss.detach()) > 0
    changed = layer.update_bias()
    assert changed is (balancing == "sign")
    if balancing == "sign":
        assert set(layer.bias.abs().tolist()) <= {0.0, float(torch.tensor(0.01))}
    if balancing == "aux_loss":
        assert layer.aux_loss.requires_grad and float(layer.aux_loss.detach()) > 0


def test_from_config_matches_the_config_parameter_count():
    from k3course.accounting import moe_layer_params
    from k3course.config import K3Config

    for name in ("tiny", "small"):
        cfg = K3Config.preset(name)
        layer = MoE.from_config(cfg, generator=torch.Generator().manual_seed(19))
        assert isinstance(layer, MoE) and layer.latent_dim == cfg.latent_dim and layer.balancer.balancing == "quantile"
        assert sum(p.numel() for p in layer.parameters()) == moe_layer_params(cfg)[0]
        x = torch.randn(2, 3, cfg.d_model)
        assert layer(x).shape == x.shape


def test_balancing_takes_the_config_spellings_only():
    from k3course.config import BALANCING

    assert all(MoE(8, 4, 2, balancing=rule).balancer.balancing == rule for rule in BALANCING)
    for old in ("aux", None):
        with pytest.raises(ValueError, match="balancing must be one of"):
            MoE(8, 4, 2, balancing=old)


def test_bad_input_names_the_argument():
    scores = seeded_scores(4, 6, seed=15)
    with pytest.raises(ValueError, match="k must satisfy 1 <= k <= n experts = 6, got k = 7"):
        topk_route(scores, 7)
    with pytest.raises(ValueError, match="got k = 0"):
        topk_route(scores, 0)
    with pytest.raises(ValueError, match="scores contains NaN"), debug.value_checks():
        topk_route(scores.clone().index_fill_(0, torch.tensor([1]), float("nan")), 2)
    with pytest.raises(ValueError, match=r"scores must have shape \[m tokens, n experts\]"):
        topk_route(scores[0], 2)
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \[n experts\] = \(6,\)"):
        topk_route(scores, 2, torch.zeros(5))
    with pytest.raises(TypeError, match="k must be an int"):
        topk_route(scores, 2.0)
    with pytest.raises(ValueError, match="top_k must satisfy"):
        MoE(8, 4, 5)
    with pytest.raises(ValueError, match=r"x must have shape \[..., d_model = 8\], got \(3, 7\)"):
        MoE(8, 4, 2)(torch.zeros(3, 7))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        MoE(8, 4, 2)(torch.zeros(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="router_score must be one of"):
        MoE(8, 4, 2, router_score="relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        MoE(8, 4, 2, activation="gelu")
    with pytest.raises(ValueError, match="expert_idx entries must lie in"), debug.value_checks():
        sort_by_expert(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"expert_idx must be an int tensor of shape \[m, k\]"):
        sort_by_expert(torch.tensor([0, 1]), 4)
    with pytest.raises(ValueError, match="must agree on d_in"):
        grouped_mm(torch.zeros(4, 3), torch.zeros(2, 5, 6), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"group_offsets must have shape \[E\] = \(2,\)"):
        grouped_mm(torch.zeros(4, 5), torch.zeros(2, 5, 6), torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped_mm(torch.zeros(4, 5), torch.zeros(2, 5, 6), torch.tensor([2, 4], dtype=torch.int32), "fast")
    with pytest.raises(ValueError, match="kernels must be one of"):
        MoE(8, 4, 2, kernels="fast")
    with pytest.raises(ValueError, match="rows_sorted has 3 rows but order has 4 entries"):
        unsort(torch.zeros(3, 2), torch.arange(4))


# --- latent pieces, accounting, benchmark ---------------------------------------------------------------

def test_rms_norm_and_latent_combine_match_reference():
    generator = torch.Generator().manual_seed(16)
    expert_out, weights = torch.randn(9, 3, 8, generator=generator), torch.rand(9, 3, generator=generator)
    up_proj, norm_weight = torch.randn(8, 12, generator=generator), torch.rand(8, generator=generator)
    u = np.einsum("mk,mkl->ml", weights.double().numpy(), expert_out.double().numpy())
    want = ref.rms_norm(u, norm_weight.double().numpy()) @ up_proj.double().numpy()
    assert_close(latent_combine(expert_out, weights, up_proj, norm_weight), want)
    half = rms_norm(torch.randn(4, 8, generator=generator).half(), torch.ones(8))
    assert half.dtype == torch.float16
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        rms_norm(torch.zeros(2, 8), torch.ones(7))


def test_k3_dispatch_bytes_equal_k2s():
    k3 = all_to_all_bytes_per_token(7168, 16, latent_dim=3584)
    k2 = all_to_all_bytes_per_token(7168, 8)
    assert k3 == k2 == 2 * 16 * 3584 * 2
    assert all_to_all_bytes_per_token(7168, 16) == 2 * k3  # K3 without the latent would pay double
    # latent halves the routed FLOPs; the projections cost 2·2·d·ℓ
    full = moe_flops_per_token(7168, 896, 16, 3072)
    latent = moe_flops_per_token(7168, 896, 16, 3072, latent_dim=3584)
    assert full - latent == 2 * 16 * 3 * 3072 * 3584 - 2 * 2 * 7168 * 3584


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_runs_small(capsys, dtype):
    from k3course.bench.moe import main

    options = ["--m", "64", "--n", "8", "--k", "2", "--d", "32", "--latent", "16", "--expert-dim", "16",
               "--repeats", "1", "--rounds", "1", "--loop-tokens", "8", "--dtype", dtype,
               "--return-freed-memory"]  # in-process: leave the test process's allocator alone
    assert main(options) == 0
    out = capsys.readouterr().out
    assert f"situ_glu, {dtype}, kernels=auto, 1 CPU thread(s)" in out
    assert "faster than the per-token loop" in out and "CPU: " in out and "bf16 " in out and "GFLOP/s" in out
    for row in ("forward", "training step"):
        assert f"{row}: sort-based MoE takes " in out
        assert f"the dense FFN's time (target <= {1.5 if dtype == 'float32' else 2.0}x in {dtype}: " in out
    stages = ("route", "down projection", "dispatch", "experts", "combine", "outside the ranges", "GEMMs")
    assert all(f"  {stage} " in out for stage in stages) and out.count("of the MoE)") == len(stages)
    assert "  bias update " in out and out.count("of the MoE's step)") == len(stages) + 1  # the step, by stage


def test_bench_dense_baseline_has_a_gemm_friendly_width_within_the_moe_flops():
    from k3course.bench.moe import dense_hidden_size

    flops = moe_flops_per_token(256, 64, 4, 128, 128)  # the bench's default layer: 362.7 hidden units' worth
    assert dense_hidden_size(flops, 256) == 352
    assert dense_hidden_size(6 * 256 * 368, 256) == 368 and dense_hidden_size(100, 256) == 16


def test_bench_rejects_a_zero_size():
    from k3course.bench.moe import main

    with pytest.raises(SystemExit):
        main(["--m", "0"])


# --- routing precision and group-limited routing -----------------------------------------------------------------

def same_expert_sets(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of tokens whose chosen experts (in any order) agree."""
    return float((a.sort(1).values == b.sort(1).values).all(1).float().mean())


def test_bf16_layer_routes_in_fp32_with_an_fp32_bias():
    """A bf16 layer on bf16 tokens picks the experts of the fp32 layer for ≥ 99.5 % of the tokens (the `small`
    preset's router, 16 experts, top-2, biases of 1e-3); routing in bf16, with a bf16 bias, would miss 2 %.
    Given the same (bf16) numbers, it is exactly the fp32 routing."""
    build = lambda: MoE(256, 16, 2, expert_dim=8, balancing="sign", generator=torch.Generator().manual_seed(40))
    full = build()
    with torch.no_grad():
        full.bias.copy_(1e-3 * torch.randn(16, generator=torch.Generator().manual_seed(41)))
    low = build()
    low.load_state_dict(full.state_dict())
    low = low.to(torch.bfloat16)
    assert low.bias.dtype == torch.float32 and torch.equal(low.bias, full.bias)
    x = torch.randn(16384, 256, generator=torch.Generator().manual_seed(42))
    chosen = low.route(x.bfloat16())[2]
    assert same_expert_sets(chosen, full.route(x)[2]) >= 0.995
    in_bf16 = topk_indices(torch.sigmoid(x.bfloat16() @ low.router) + full.bias.bfloat16(), 2)
    assert same_expert_sets(in_bf16, full.route(x)[2]) < 0.99
    full.router.data = low.router.data.float()
    assert torch.equal(chosen, full.route(x.bfloat16().float())[2])
    assert low.double().bias.dtype == torch.float64 and low.float().bias.dtype == torch.float32


def test_group_limited_routing_picks_top_k_inside_the_best_groups():
    """DeepSeek-V3's rule, checked token by token: groups score the sum of their two best biased scores, the best
    topk_groups groups are kept, the k experts are the best of the kept ones."""
    scores = torch.rand(50, 12, generator=torch.Generator().manual_seed(43))
    bias = 0.1 * torch.randn(12, generator=torch.Generator().manual_seed(44))
    idx, weights = topk_route(scores, 3, bias, n_expert_groups=4, topk_groups=2)
    biased = scores + bias
    for t in range(50):
        group_scores = biased[t].view(4, 3).topk(2).values.sum(-1)
        kept = group_scores.topk(2).indices
        allowed = torch.cat([torch.arange(3 * g, 3 * g + 3) for g in kept.tolist()])
        want = allowed[biased[t, allowed].topk(3).indices]
        assert set(idx[t].tolist()) == set(want.tolist())
    assert torch.allclose(weights, scores.gather(1, idx) / scores.gather(1, idx).sum(1, keepdim=True))
    raw = topk_route(scores, 3, bias, renormalize=False, n_expert_groups=4, topk_groups=2)[1]
    assert torch.equal(raw, scores.gather(1, idx))
    with pytest.raises(ValueError, match="k = 7 exceeds the 6 experts"):
        topk_route(scores, 7, bias, n_expert_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="n_expert_groups must divide n_routed_experts"):
        MoE(12, 12, 2, n_expert_groups=5)


def test_the_split_layer_keeps_its_checkpoint_names_and_parameter_order():
    """Router, bank and balancer are parts of the layer, not new owners of its tensors: checkpoints, the pretrained
    name maps and optimizer states (kept by parameter position) written before the split load unchanged."""
    layer = LatentMoE(16, 8, 2, n_shared_experts=1, expert_dim=8, device="meta")
    assert list(layer.state_dict()) == ["router", "down_proj", "up_proj", "latent_norm", "bias", "experts.gate_up",
                                        "experts.down", "shared.gate", "shared.up", "shared.down"]
    assert [name for name, _ in layer.named_parameters()] == ["router", "down_proj", "up_proj", "latent_norm",
                                                             "experts.gate_up", "experts.down", "shared.gate",
                                                             "shared.up", "shared.down"]
