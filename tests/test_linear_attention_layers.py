"""The layers around the ops (decoding with state equals the full forward), the parallel form, MQAR data."""

from __future__ import annotations

import pytest
import torch
from test_kda import assert_close, inputs

from k3course.data import IGNORE, mqar
from k3course.layers import DecayedLinearAttention, GatedDeltaNet, KimiDeltaAttention
from k3course.layers.kda import initial_dt_bias, kda_gate, short_conv
from k3course.ops import decay_attention_parallel, gla_recurrent, softmax_attention

LAYERS = [
    (KimiDeltaAttention, {}),
    (KimiDeltaAttention, {"lower_bound": None, "output_gate": "low_rank"}),
    (KimiDeltaAttention, {"mode": "recurrent"}),
    (KimiDeltaAttention, {"allow_neg_eigval": True}),
    (GatedDeltaNet, {}),
    (DecayedLinearAttention, {}),
]


@pytest.mark.parametrize("cls, kwargs", LAYERS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_token_by_token_decoding_equals_full_forward(cls, kwargs):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = cls(24, 2, 8, chunk_size=16, **kwargs)
        x = torch.randn(2, 37, 24)
    y_full, state_full = layer(x)
    state, pieces = None, []
    for t in range(x.shape[1]):
        y_t, state = layer(x[:, t:t + 1], state)
        pieces.append(y_t)
    assert_close(torch.cat(pieces, 1).detach(), y_full.detach(), 1e-5, "decoded outputs")
    assert_close(state.state, state_full.state, 1e-5, "recurrent state")
    y_a, state_a = layer(x[:, :20])  # prefill then continue with a longer piece
    y_b, _ = layer(x[:, 20:], state_a)
    assert_close(torch.cat([y_a, y_b], 1).detach(), y_full.detach(), 1e-5, "prefill + continue")


def test_layer_backward_reaches_every_parameter():
    with torch.random.fork_rng():
        torch.manual_seed(1)
        layer = KimiDeltaAttention(16, 2, 8, chunk_size=16)
        x = torch.randn(1, 20, 16)
    layer(x)[0].square().sum().backward()
    missing = [name for name, p in layer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient for {missing}"


def test_kda_gate_bounds_and_initial_rates():
    z = torch.linspace(-50, 50, 101).view(1, 101, 1, 1).expand(1, 101, 2, 3)
    g = kda_gate(z, torch.zeros(2), torch.zeros(2, 3))
    assert (g >= -5).all() and (g <= 0).all() and g.min() == -5  # saturates at the bound, never beyond
    g_unbounded = kda_gate(z, torch.zeros(2), torch.zeros(2, 3), lower_bound=None)
    assert g_unbounded.min() < -40  # Kimi Linear's gate is not bounded below
    for lower_bound in (-5.0, None):
        rates = -kda_gate(torch.zeros(1, 1, 1, 8), torch.zeros(1), initial_dt_bias(8, lower_bound).view(1, 8),
                          lower_bound)
        assert_close(rates.flatten(), torch.logspace(-2, torch.log10(torch.tensor(0.5)).item(), 8), 1e-5)


def test_short_conv_is_causal_and_caches_its_tail():
    x, weight = torch.randn(1, 9, 3), torch.randn(3, 4)
    y, tail = short_conv(x, weight)
    x_changed = x.clone()
    x_changed[:, 5:] += 1.0
    assert torch.equal(short_conv(x_changed, weight)[0][:, :5], y[:, :5])
    assert torch.equal(tail, x[:, -3:])
    y_a, cache = short_conv(x[:, :4], weight)
    assert_close(torch.cat([y_a, short_conv(x[:, 4:], weight, cache)[0]], 1), y, 1e-6)


def test_parallel_form_matches_recurrence_and_softmax_attention_is_causal():
    q, k, v, g, _, _ = inputs(13, seed=3)
    assert_close(decay_attention_parallel(q, k, v, g), gla_recurrent(q, k, v, g)[0], 1e-5)
    o = softmax_attention(q, k, v)
    v_changed = v.clone()
    v_changed[:, 7:] = 0
    assert torch.equal(softmax_attention(q, k, v_changed)[:, :7], o[:, :7])


def test_layer_rejects_bad_mode_and_shape():
    with pytest.raises(ValueError, match="mode must be"):
        KimiDeltaAttention(8, 1, 8, mode="fast")
    with pytest.raises(ValueError, match=r"x must be \[B, T, d_model=8\]"):
        KimiDeltaAttention(8, 1, 8)(torch.randn(3, 8))


def test_mqar_layout_and_seeding():
    tokens, targets = mqar(5, 30, 6, 40, seed=7)
    assert tokens.shape == targets.shape == (5, 30) and tokens.dtype == torch.int64
    assert torch.equal(tokens, mqar(5, 30, 6, 40, seed=7)[0])
    assert not torch.equal(tokens, mqar(5, 30, 6, 40, seed=8)[0])
    for row_tokens, row_targets in zip(tokens, targets):
        keys, values = row_tokens[0:12:2].tolist(), row_tokens[1:12:2].tolist()
        assert len(set(keys)) == 6 and all(1 <= key < 20 for key in keys) and all(20 <= v < 40 for v in values)
        asked = (row_targets != IGNORE).nonzero().flatten()
        assert len(asked) == 6 and asked.min() >= 12
        for position in asked.tolist():  # the target is the value stored with the queried key
            assert row_targets[position] == values[keys.index(row_tokens[position].item())]


def test_mqar_rejects_impossible_settings():
    with pytest.raises(ValueError, match="n_pairs must be"):
        mqar(2, 100, 30, 40, seed=0)
    with pytest.raises(ValueError, match="seq_len must be"):
        mqar(2, 10, 4, 40, seed=0)
