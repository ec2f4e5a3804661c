"""The toy decoder used by lesson 10: every residual scheme plugs in, trains, and the data has a true floor."""

from __future__ import annotations

import pytest
import torch

from k3course.lessons.residual_experiment import (
    CausalSelfAttention,
    ToyDecoder,
    markov_batch,
    markov_table,
    sublayer_input_rms,
    train_toy,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops: a second thread only adds contention (these tests run next to others on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_markov_table_rows_are_distributions_and_seeded():
    table = markov_table(6, seed=3)
    torch.testing.assert_close(table.sum(-1), torch.ones(6, 6))
    torch.testing.assert_close(markov_table(6, seed=3), table)
    assert not torch.allclose(markov_table(6, seed=4), table)


def test_markov_batch_follows_the_table():
    table = torch.zeros(3, 3, 3)
    table[..., 1] = 1.0                                   # the chain always emits token 1
    inputs, targets, floor = markov_batch(table, 4, 5, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (4, 5)
    assert (targets[:, 1:] == 1).all() and floor == pytest.approx(0.0)
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])


def test_causal_attention_ignores_the_future():
    torch.manual_seed(0)
    attention = CausalSelfAttention(8, 2)
    x = torch.randn(1, 6, 8)
    changed = x.clone()
    changed[:, 4:] += 1
    torch.testing.assert_close(attention(changed)[:, :4], attention(x)[:, :4])
    with pytest.raises(ValueError, match="d_model=9 must be divisible by n_heads=2"):
        CausalSelfAttention(9, 2)


@pytest.mark.parametrize("residual, block_size", [("prenorm", None), ("full_attnres", None), ("block_attnres", 2)])
def test_every_scheme_trains_below_its_start(residual, block_size):
    result = train_toy(residual, seed=0, steps=25, vocab=6, d_model=16, n_layers=2, block_size=block_size,
                       batch=8, length=12)
    assert result["losses"][-5:].mean() < result["losses"][:5].mean()
    assert result["eval_loss"] > result["floor"] - 0.05           # no model beats the chain's own entropy
    rms = sublayer_input_rms(result["model"], torch.zeros(2, 12, dtype=torch.long))
    assert rms.shape == (5,) and torch.isfinite(rms).all()


def test_prenorm_stream_grows_and_attnres_stays_bounded_at_init():
    tokens = torch.randint(8, (4, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    standard = sublayer_input_rms(ToyDecoder(8, 16, 8, "prenorm"), tokens)
    torch.manual_seed(0)
    full = sublayer_input_rms(ToyDecoder(8, 16, 8, "full_attnres"), tokens)
    assert standard[-1] > 1.1 * standard[0]                      # outputs pile up on the stream
    assert full.max() <= standard[0] + 1e-6                      # a uniform average never exceeds its sources


def test_too_long_sequence_is_named():
    with pytest.raises(ValueError, match="length 9 exceeds max_len=8"):
        ToyDecoder(4, 8, 1, "prenorm", max_len=8)(torch.zeros(1, 9, dtype=torch.long))
