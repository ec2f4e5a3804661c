"""Balancing rules against the NumPy reference, the histogram estimate, and the online acceptance experiment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3course import debug
from k3course.moe import (
    LatentMoE,
    LocalDispatch,
    MoE,
    bias_from_histogram,
    expert_load,
    histogram_quantile_bias,
    load_entropy,
    load_statistics,
    max_violation,
    quantile_balance_bias,
    quantile_balance_bias_from_histograms,
    router_scores,
    router_z_loss,
    sign_rule_update,
    switch_aux_loss,
    topk_route,
)
from k3course.moe.simulate import simulate_balancing
from k3course.reference import moe as ref


def seeded(m: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed))


def test_aux_and_z_loss_match_reference():
    logits = seeded(37, 8, 0)
    probs = router_scores(logits, "softmax")
    idx, _ = topk_route(probs, 3)
    assert np.isclose(float(switch_aux_loss(probs, idx, 0.5)),
                      ref.switch_aux_loss(probs.double().numpy(), idx.numpy(), 0.5), rtol=1e-5)
    assert np.isclose(float(router_z_loss(logits)), ref.router_z_loss(logits.double().numpy()), rtol=1e-5)


def test_aux_loss_is_alpha_when_balanced_and_its_gradient_reaches_probs_only():
    probs = torch.full((8, 4), 0.25, requires_grad=True)
    idx = torch.tensor([[0], [1], [2], [3], [0], [1], [2], [3]])
    loss = switch_aux_loss(probs, idx, alpha=0.1)
    assert torch.isclose(loss, torch.tensor(0.1))
    loss.backward()
    assert torch.allclose(probs.grad, torch.full((8, 4), 0.1 * 4 * 0.25 / 8))


def test_sign_rule_matches_reference():
    bias, load = torch.tensor([0.1, 0.0, -0.2, 0.0]), torch.tensor([5, 3, 1, 3])
    want = ref.sign_rule_update(bias.double().numpy(), load.numpy(), 0.01)
    assert torch.allclose(sign_rule_update(bias, load, 0.01).double(), torch.from_numpy(want))


@pytest.mark.parametrize("m, n, k", [(37, 8, 1), (64, 8, 7), (101, 16, 4)])
def test_quantile_balance_matches_reference(m, n, k):
    scores = router_scores(seeded(m, n, 1))
    bias = 0.1 * seeded(1, n, 2)[0]
    want = ref.quantile_balance_bias(scores.double().numpy(), bias.double().numpy(), k)
    got = quantile_balance_bias(scores, bias, k)
    assert got.dtype == torch.float32 and np.allclose(got.double().numpy(), want, atol=1e-6)


def test_quantile_balance_with_ties_is_the_reference_and_is_order_free():
    scores = torch.tensor([[0.5, 0.5, 0.5, 0.2], [0.9, 0.5, 0.5, 0.5], [0.5, 0.5, 0.1, 0.5]] * 4)
    bias = torch.zeros(4)
    got = quantile_balance_bias(scores, bias, 2)
    want = ref.quantile_balance_bias(scores.double().numpy(), bias.double().numpy(), 2)
    assert np.allclose(got.double().numpy(), want, atol=1e-7)
    shuffled = scores[torch.randperm(12, generator=torch.Generator().manual_seed(3))]
    assert torch.equal(quantile_balance_bias(shuffled, bias, 2), got)


def test_quantile_step_balances_the_batch_it_was_computed_on():
    scores = router_scores(seeded(2048, 16, 4) + 2 * seeded(1, 16, 5))  # skewed
    bias = torch.zeros(16)
    before = max_violation(expert_load(topk_route(scores, 2, bias)[0], 16))
    for _ in range(5):  # each step fixes the experts' prices for the token cutoffs of the last bias
        bias = quantile_balance_bias(scores, bias, 2)
    after = max_violation(expert_load(topk_route(scores, 2, bias)[0], 16))
    assert before > 5.0 and after < 0.1


@pytest.mark.parametrize("bins", [16, 64, 256])
def test_histogram_estimate_is_within_one_bin_of_the_exact_step(bins):
    scores = router_scores(seeded(1000, 12, 6) + seeded(1, 12, 7))
    bias = 0.2 * seeded(1, 12, 8)[0]
    shards = list(scores.split([300, 450, 250]))  # three ranks, uneven
    exact = quantile_balance_bias(scores, bias, 3)
    estimate = quantile_balance_bias_from_histograms(shards, bias, 3, bins)
    cutoffs = (scores + bias).sort(1, descending=True).values[:, 3]
    margins = scores - cutoffs[:, None]
    width = float(margins.max() - margins.min()) / bins
    assert (estimate - exact).abs().max() <= width
    assert (estimate - exact).abs().max() > 0  # a real estimate, not the exact computation


def test_bias_from_histogram_reads_from_the_top():
    edges = torch.tensor([0.0, 1.0, 2.0, 3.0])
    counts = torch.tensor([[5, 0, 2], [1, 1, 5]])  # expert 0: 2 in the top bin; expert 1: 5
    # q = 2: the 3rd largest margin lies in bin [0, 1) for expert 0, in [2, 3) for expert 1
    got = bias_from_histogram(counts, edges, 2)
    assert torch.allclose(got, torch.tensor([1.0, -1.0], dtype=torch.float64))  # −midpoints, mean-centred
    with pytest.raises(ValueError, match="target must be <"):
        bias_from_histogram(counts, edges, 7)


def test_load_statistics():
    load = torch.tensor([4, 4, 4, 4])
    assert max_violation(load) == 0 and load_entropy(load) == pytest.approx(1.0)
    load = torch.tensor([8, 0, 0, 0])
    assert max_violation(load) == 3 and load_entropy(load) == 0
    statistics = load_statistics(load)
    assert statistics["load"] is load and (statistics["max_violation"], statistics["entropy"]) == (3.0, 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_acceptance_quantile_balances_in_five_steps_sign_rule_not_in_a_hundred(seed):
    """m = 4096, n = 64, k = 4, skewed sigmoid router, fresh batch per step, bias used from the next step."""
    quantile = simulate_balancing("quantile", steps=6, m=4096, n_experts=64, k=4, seed=seed)
    sign = simulate_balancing("sign", steps=101, m=4096, n_experts=64, k=4, gamma=1e-3, seed=seed)
    assert quantile[0] > 5 and sign[0] == quantile[0]  # the same skewed start
    assert quantile[5] <= 0.3, quantile
    assert sign[100] > 0.5, sign[100]


def test_aux_loss_alone_balances_the_router_by_moving_its_weights():
    violations = simulate_balancing("aux_loss", steps=30, m=512, n_experts=16, k=2, lr=10.0)
    assert violations[0] > 2 and violations[-1] < 0.5 * violations[0]


def test_bad_balancing_input_names_the_argument():
    scores = router_scores(seeded(10, 4, 9))
    with pytest.raises(ValueError, match="k must satisfy"):
        quantile_balance_bias(scores, torch.zeros(4), 5)
    with pytest.raises(ValueError, match="bias must be a tensor of shape"):
        quantile_balance_bias(scores, torch.zeros(3), 2)
    with pytest.raises(ValueError, match="bins must be a positive int"):
        quantile_balance_bias_from_histograms([scores], torch.zeros(4), 2, bins=0)
    with pytest.raises(ValueError, match="load must have the shape of bias"):
        sign_rule_update(torch.zeros(4), torch.zeros(3), 0.1)
    with pytest.raises(ValueError, match="probs contains NaN"), debug.value_checks():
        switch_aux_loss(torch.full((2, 4), float("nan")), torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="rule must be"):
        simulate_balancing("adam", 1)


def _recording(calls: list):
    """A reduction over one holder that records (op, shape) of each call."""
    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        calls.append((op, tuple(tensor.shape)))
        return tensor
    return reduce


def test_histogram_routine_reduces_the_range_and_counts_once_and_the_tokens_only_when_not_given():
    scores = router_scores(seeded(200, 8, 11))
    bias, calls = 0.1 * seeded(1, 8, 12)[0], []
    got = histogram_quantile_bias(scores, bias, 2, 32, _recording(calls), tokens=200)
    assert calls == [("max", (2,)), ("sum", (8, 32))]
    assert torch.equal(got, quantile_balance_bias_from_histograms(list(scores.split([50, 150])), bias, 2, 32))
    calls.clear()
    assert torch.equal(histogram_quantile_bias(scores, bias, 2, 32, _recording(calls)), got)
    assert calls == [("sum", ()), ("max", (2,)), ("sum", (8, 32))]


def test_histogram_routine_with_every_expert_chosen_centres_the_bias_without_reducing():
    scores, bias, calls = router_scores(seeded(30, 6, 13)), seeded(1, 6, 14)[0], []
    got = histogram_quantile_bias(scores, bias, 6, reduce=_recording(calls))
    assert torch.equal(got, bias - bias.mean()) and calls == []
    assert torch.equal(quantile_balance_bias_from_histograms([scores[:0], scores], bias, 6), got)
    with pytest.raises(ValueError, match="at least one token"):
        histogram_quantile_bias(scores[:0], bias, 2)


def test_histogram_routine_builds_every_tensor_on_the_scores_device():
    scores, bias = router_scores(seeded(64, 8, 15)), seeded(1, 8, 16)[0]
    want = histogram_quantile_bias(scores, bias, 3, 16)
    with torch.device("meta"):  # a tensor made without device= would land on meta and mix with the CPU scores
        got = histogram_quantile_bias(scores, bias, 3, 16)
    assert got.device == scores.device and torch.equal(got, want)


@pytest.mark.parametrize("latent", [False, True])
@pytest.mark.parametrize("balancing", ["quantile", "sign"])
def test_moe_forward_backward_and_update_bias_run_on_the_meta_device(latent, balancing):
    cls = LatentMoE if latent else MoE
    layer = cls(16, 8, 2, n_shared_experts=1, expert_dim=8, balancing=balancing, kernels="torch",
                device="meta").bfloat16().train()  # torch's grouped GEMM: no host read of the block sizes
    y = layer(torch.empty(5, 16, device="meta", dtype=torch.bfloat16))
    y.sum().backward()
    assert y.shape == (5, 16) and y.device.type == "meta"
    assert layer.update_bias() and layer.bias.device.type == "meta" and layer.bias.dtype == torch.float32


class _CountingDispatch(LocalDispatch):
    """The one-process dispatcher, counting its pooling reductions."""

    def __init__(self):
        self.pools = 0

    def pool_counts(self, tokens, load):
        self.pools += 1
        return super().pool_counts(tokens, load)


@pytest.mark.parametrize("balancing", ["quantile", "sign"])
def test_a_step_pools_the_token_count_once_for_the_statistics_and_the_rule(balancing):
    layer = MoE(16, 8, 2, balancing=balancing, generator=torch.Generator().manual_seed(3)).train()
    layer.dispatcher = _CountingDispatch()
    plain = MoE(16, 8, 2, balancing=balancing, generator=torch.Generator().manual_seed(3)).train()
    x = seeded(30, 16, 4)
    for step in range(2):
        layer(x[:10])
        assert layer.load_statistics()["tokens"] == 10  # pools
        layer(x[10:])  # a new forward: the pooled counts are stale
        statistics = layer.load_statistics()
        assert statistics["tokens"] == 30 and int(statistics["load"].sum()) == 60
        statistics["load"].zero_()  # the caller's copy: the rule reads its own
        assert layer.update_bias()
        assert layer.dispatcher.pools == 2 * (step + 1)  # the rule reused the second pooling
        plain(x[:10])
        plain(x[10:])
        plain.update_bias()  # no statistics read: pools inside the rule
        assert torch.equal(layer.bias, plain.bias) and plain.bias.abs().sum() > 0
