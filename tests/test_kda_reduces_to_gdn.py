"""KDA whose forget gate is equal across a head's channels computes exactly GDN (chapter 06's reduction): the same
weights give the same outputs, chunked and recurrent, so any difference a comparison finds between the two layers
comes from the per-channel gate (or from how the two start), never from the rest of the layer."""

from __future__ import annotations

import pytest
import torch

from k3course.layers.kda import GatedDeltaNet, KimiDeltaAttention

D, H, K = 24, 3, 8


def kda_as_gdn(seed: int, dtype=torch.float64) -> tuple[KimiDeltaAttention, GatedDeltaNet]:
    """A GDN layer and the KDA layer (Kimi Linear's unbounded gate) with its weights, its gate made per-head constant:
    f_proj's second map repeats one row per head over the head's K channels, and dt_bias is the head's bias on every
    channel, so g_{t,h,c} = −e^{A_log_h} softplus(w_h · W₀ x_t + b_h) for every channel c = GDN's g_{t,h}."""
    torch.manual_seed(seed)
    gdn = GatedDeltaNet(D, H, K).to(dtype)
    kda = KimiDeltaAttention(D, H, K, lower_bound=None).to(dtype)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "q_conv", "k_conv", "v_conv", "b_proj", "gate_proj", "o_proj"):
            getattr(kda, name).load_state_dict(getattr(gdn, name).state_dict())
        kda.o_norm_weight.copy_(gdn.o_norm_weight)
        gdn.A_log.normal_(0, 0.5)
        gdn.dt_bias.normal_(0, 1)
        kda.A_log.copy_(gdn.A_log)
        kda.dt_bias.copy_(gdn.dt_bias[:, None].expand(H, K))
        head_rows = torch.randn(H, K, dtype=dtype)  # w_h: one row of the second map per head
        kda.f_proj[1].weight.copy_(head_rows.repeat_interleave(K, dim=0))  # [H·K, K]: row h·K + c = w_h
        gdn.a_proj.weight.copy_(head_rows @ kda.f_proj[0].weight)  # [H, d]: a_h = w_h · W₀
    return kda, gdn


@pytest.mark.parametrize("tokens", [1, 7, 64, 100])
@pytest.mark.parametrize("training", [True, False])
def test_kda_with_a_per_head_gate_is_gdn(tokens, training):
    kda, gdn = kda_as_gdn(seed=tokens)
    kda.train(training), gdn.train(training)
    x = torch.randn(2, tokens, D, dtype=torch.float64)
    g_kda = kda.log_decay(x)  # [B, T, H, K]
    assert torch.allclose(g_kda, gdn.log_decay(x)[..., None].expand_as(g_kda), rtol=0, atol=1e-13)
    (y_kda, cache_kda), (y_gdn, cache_gdn) = kda(x), gdn(x)
    assert torch.allclose(y_kda, y_gdn, rtol=0, atol=1e-10 * y_gdn.abs().max().item())
    assert torch.allclose(cache_kda.state, cache_gdn.state, rtol=0, atol=1e-10 * cache_gdn.state.abs().max().item())


def test_the_reduction_holds_through_cached_decoding():
    kda, gdn = kda_as_gdn(seed=1)
    kda.eval(), gdn.eval()
    x = torch.randn(1, 40, D, dtype=torch.float64)
    caches = [layer.new_cache(1) for layer in (kda, gdn)]
    for t in range(40):
        y_kda, _ = kda(x[:, t:t + 1], caches[0])
        y_gdn, _ = gdn(x[:, t:t + 1], caches[1])
        assert torch.allclose(y_kda, y_gdn, rtol=0, atol=1e-12)


def test_a_per_channel_gate_departs_from_gdn():
    """The test can fail: spread one head's channels apart and KDA is no longer GDN."""
    kda, gdn = kda_as_gdn(seed=2)
    with torch.no_grad():
        kda.dt_bias[0, 0] += 2.0
    x = torch.randn(2, 32, D, dtype=torch.float64)
    assert (kda(x)[0] - gdn(x)[0]).abs().max() > 1e-4
