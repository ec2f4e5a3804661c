"""The discriminating experiments of lessons 04-06 (k3course.lessons.decay_tasks): task generators, the
hand-built solution of the two-timescales task, the DeltaNet layer, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from k3course.data import IGNORE
from k3course.layers.kda import GatedDeltaNet
from k3course.lessons.decay_tasks import (
    NONE,
    SEPARATOR,
    DecayMemory,
    DeltaNet,
    forget_model,
    recall_seeds,
    retention_at_separators,
    segment_accuracy,
    segment_recall,
    train_segment_recall,
    train_two_timescales,
    two_timescales,
)

# --- two timescales ---------------------------------------------------------------------------------------


def test_two_timescales_layout_and_targets():
    inputs, targets = two_timescales(5, 30, seed=3, fast_decay=0.6)
    assert inputs.shape == (5, 30, 4) and targets.shape == (5, 30, 2)
    assert inputs.dtype == targets.dtype == torch.float32
    kept, stream, marker, constant = inputs.unbind(-1)
    assert (kept[:, 1:] == 0).all() and (stream[:, 0] == 0).all()
    assert (marker[:, 0] == 1).all() and (marker[:, 1:] == 0).all() and (constant == 1).all()
    assert torch.equal(targets[..., 0], kept[:, :1].expand(-1, 30))
    average = torch.zeros(5)
    for t in range(30):  # m_t = λ m_{t-1} + a_t, scaled to unit variance
        average = 0.6 * average + stream[:, t]
        torch.testing.assert_close(targets[:, t, 1], average * math.sqrt(1 - 0.36))


def test_two_timescales_is_seeded():
    first, second, other = two_timescales(3, 10, 7), two_timescales(3, 10, 7), two_timescales(3, 10, 8)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], other[0])


def test_the_running_average_has_unit_variance():
    _, targets = two_timescales(4000, 40, seed=0, fast_decay=0.7)
    assert abs(targets[:, 20:, 1].var().item() - 1) < 0.05
    assert abs(targets[:, 0, 0].var().item() - 1) < 0.1


def exact_channel_solution(fast_decay: float) -> DecayMemory:
    """Row 0 of the state keeps c forever (α = 1), row 1 keeps the stream at α = λ; inputs (c, a, marker, 1)."""
    model = DecayMemory("channel", n_heads=1, key_dim=2, value_dim=2)
    with torch.no_grad():
        model.q_proj.weight.copy_(torch.tensor([[0.0, 0, 0, 1], [0, 0, 0, 1]]))    # q = (1, 1)
        model.k_proj.weight.copy_(torch.tensor([[0.0, 0, 1, 0], [0, 0, -1, 1]]))   # k = (marker, 1 − marker)
        model.v_proj.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0]]))    # v = (c, a)
        model.g_proj.weight.zero_()
        rate = -math.log(fast_decay)
        model.g_proj.bias.copy_(torch.tensor([-30.0, math.log(math.expm1(rate))]))  # −g = (≈0, −log λ)
        model.o_proj.weight.copy_(torch.diag(torch.tensor([1.0, math.sqrt(1 - fast_decay**2)])))
    return model


def test_the_channel_gate_can_represent_the_solution_exactly():
    inputs, targets = two_timescales(16, 64, seed=1, fast_decay=0.7)
    with torch.no_grad():
        error = (exact_channel_solution(0.7)(inputs) - targets).abs().max().item()
    assert error < 1e-4


def test_a_scalar_gate_is_a_channel_gate_with_equal_rates():
    torch.manual_seed(0)
    channel, scalar = DecayMemory("channel", key_dim=3), DecayMemory("scalar", key_dim=3)
    scalar.load_state_dict({**channel.state_dict(), "g_proj.weight": channel.g_proj.weight[:1],
                            "g_proj.bias": channel.g_proj.bias[:1]})
    with torch.no_grad():
        channel.g_proj.weight.copy_(channel.g_proj.weight[:1].expand(3, -1))
        channel.g_proj.bias.fill_(channel.g_proj.bias[0].item())
        inputs, _ = two_timescales(4, 12, seed=2)
        torch.testing.assert_close(channel(inputs), scalar(inputs))
    assert scalar.log_decay(inputs).shape == (4, 12, 1) and channel.log_decay(inputs).shape == (4, 12, 1, 3)


def test_training_is_seeded_and_learns_the_channel_task():
    first = train_two_timescales("channel", steps=60, batch_size=16, seq_len=24, seed=5)
    second = train_two_timescales("channel", steps=60, batch_size=16, seq_len=24, seed=5)
    assert first["losses"] == second["losses"]
    assert first["losses"][-1] < 0.5 * first["losses"][0]
    assert set(first["errors"]) == {"kept value", "running average"} and first["retention"].shape == (1, 4)


@pytest.mark.parametrize("kwargs, name", [(dict(n_samples=0), "n_samples"), (dict(seq_len=1), "seq_len"),
                                          (dict(fast_decay=1.0), "fast_decay"), (dict(n_samples=2.5), "n_samples")])
def test_two_timescales_rejects_bad_input(kwargs, name):
    arguments = dict(n_samples=2, seq_len=8, seed=0) | kwargs
    with pytest.raises(ValueError, match=name):
        two_timescales(**arguments)


def test_decay_memory_rejects_bad_input():
    with pytest.raises(ValueError, match="gate"):
        DecayMemory("vector")
    with pytest.raises(ValueError, match="key_dim"):
        DecayMemory("scalar", key_dim=0)
    with pytest.raises(ValueError, match="n_inputs=4"):
        DecayMemory("scalar")(torch.zeros(2, 5, 3))
    with pytest.raises(ValueError, match="steps"):
        train_two_timescales("scalar", steps=0)


# --- segment recall ---------------------------------------------------------------------------------------


def test_segment_recall_layout_and_answers():
    n_segments, n_pairs, n_queries, vocab = 3, 4, 4, 32
    tokens, targets, stale = segment_recall(20, n_segments, n_pairs, n_queries, vocab, seed=0)
    length = 1 + 2 * n_pairs + n_queries
    assert tokens.shape == targets.shape == stale.shape == (20, n_segments * length) and stale.dtype == torch.bool
    for row in range(20):
        previous = set()
        for index in range(n_segments):
            part = slice(index * length, (index + 1) * length)
            seg, answers, seg_stale = tokens[row, part], targets[row, part], stale[row, part]
            assert seg[0] == SEPARATOR and (answers[:1 + 2 * n_pairs] == IGNORE).all()
            keys, values = seg[1:1 + 2 * n_pairs:2].tolist(), seg[2:1 + 2 * n_pairs:2].tolist()
            assert len(set(keys)) == n_pairs and all(3 <= k < vocab // 2 <= v < vocab for k, v in zip(keys, values))
            stored = dict(zip(keys, values))
            asked, answered = seg[1 + 2 * n_pairs:].tolist(), answers[1 + 2 * n_pairs:].tolist()
            assert sum(a == NONE for a in answered) == n_queries // 2
            for key, answer, is_stale in zip(asked, answered, seg_stale[1 + 2 * n_pairs:].tolist()):
                assert answer == stored[key] if key in stored else answer == NONE
                assert is_stale == (answer == NONE and index > 0)
                if is_stale:
                    assert key in previous  # the state may still hold it from the segment before
            previous = set(keys)


def test_segment_recall_is_seeded():
    first, second = segment_recall(4, 2, 3, 2, 32, seed=1), segment_recall(4, 2, 3, 2, 32, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], segment_recall(4, 2, 3, 2, 32, seed=2)[0])


@pytest.mark.parametrize("kwargs, name", [(dict(n_pairs=0), "n_pairs"), (dict(n_queries=1), "n_queries"),
                                          (dict(vocab_size=16), "vocab_size"), (dict(n_segments=0), "n_segments"),
                                          (dict(n_pairs=1, n_queries=6), "n_queries")])
def test_segment_recall_rejects_bad_input(kwargs, name):
    arguments = dict(n_samples=2, n_segments=2, n_pairs=4, n_queries=4, vocab_size=32, seed=0) | kwargs
    with pytest.raises(ValueError, match=name):
        segment_recall(**arguments)


def test_deltanet_is_gdn_with_the_forget_gate_off():
    torch.manual_seed(0)
    delta = DeltaNet(16, 2, 8, chunk_size=8)
    gdn = GatedDeltaNet(16, 2, 8, chunk_size=8)
    assert not {"a_proj.weight", "A_log", "dt_bias"} & set(dict(delta.named_parameters()))
    missing = gdn.load_state_dict(delta.state_dict(), strict=False).missing_keys
    assert set(missing) == {"a_proj.weight", "A_log", "dt_bias"}
    with torch.no_grad():
        gdn.A_log.fill_(-math.inf)  # g = −e^{A_log}·softplus(·) = 0
        x = torch.randn(2, 20, 16)
        torch.testing.assert_close(delta(x)[0], gdn(x)[0])
        assert torch.equal(delta.log_decay(x), torch.zeros(2, 20, 2))


def test_forget_model_and_training():
    assert all(isinstance(m, DeltaNet) for m in forget_model("DeltaNet", 32, d_model=16).mixers)
    assert not any(isinstance(m, DeltaNet) for m in forget_model("GDN", 32, d_model=16).mixers)
    with pytest.raises(ValueError, match="mixer"):
        forget_model("KDA", 32)
    result = train_segment_recall("GDN", steps=3, batch_size=4, d_model=16, chunk_size=8, seed=0)
    again = train_segment_recall("GDN", steps=3, batch_size=4, d_model=16, chunk_size=8, seed=0)
    assert result["losses"] == again["losses"] and set(result["accuracy"]) == {"stored", "stale"}


def test_segment_accuracy_counts_the_right_queries():
    tokens, targets, stale = segment_recall(8, 3, 4, 4, 32, seed=0)

    class Oracle(torch.nn.Module):  # answers every query right except the stale ones, where it says "value 31"
        def forward(self, tokens):
            answers = torch.where(stale, torch.full_like(targets, 31), targets.clamp(min=0))
            return torch.nn.functional.one_hot(answers, 32).float()

    assert segment_accuracy(Oracle(), tokens, targets, stale) == {"stored": 1.0, "stale": 0.0}


# --- recall over seeds ------------------------------------------------------------------------------------


def test_recall_seeds_runs_every_mixer_and_seed():
    setting = dict(steps=2, batch_size=4, seq_len=12, n_pairs=3, vocab_size=16, d_model=16, chunk_size=4)
    results = recall_seeds(["GDN", "decayed linear"], [0, 1], progress=False, **setting)
    assert list(results) == ["GDN", "decayed linear"] and all(len(runs) == 2 for runs in results.values())
    assert results["GDN"][0]["losses"] != results["GDN"][1]["losses"]
    with pytest.raises(ValueError, match="seeds"):
        recall_seeds(["GDN"], [], **setting)


def test_retention_at_separators_reads_each_layers_gate():
    torch.manual_seed(0)
    tokens, _, _ = segment_recall(4, 3, 3, 2, 32, seed=0)
    gdn, delta = forget_model("GDN", 32, d_model=16, n_heads=2), forget_model("DeltaNet", 32, d_model=16, n_heads=2)
    for layer in gdn.mixers:  # make the gate a function of the token: forget fully at the separator only
        layer.log_decay = lambda x: torch.where(tokens[..., None] == SEPARATOR, -3.0, -0.1).expand(*x.shape[:2], 2)
    measured = retention_at_separators(gdn, tokens)
    torch.testing.assert_close(measured["separator"], torch.full((2, 2), math.exp(-3.0)))
    torch.testing.assert_close(measured["other"], torch.full((2, 2), math.exp(-0.1)))
    assert (retention_at_separators(delta, tokens)["separator"] == 1).all()
    assert not gdn.mixers[0]._forward_pre_hooks  # the hooks are removed
