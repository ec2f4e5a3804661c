"""Lesson 12's instrumented short runs (k3course.lessons.probes): the run is the claims' run, the router trace is
recorded where the scores are, and the saturated router's split jumps where an unsaturated one moves smoothly."""

from __future__ import annotations

import pytest
import torch

from k3course import data, train
from k3course.config import K3Config
from k3course.lessons import claims
from k3course.lessons.probes import probe_run, saturated_split

MODEL = K3Config.preset("tiny").replace(
    name="test", d_model=32, n_layers=2, kda_n_heads=2, kda_head_dim=16, mla_n_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, expert_dim=32,
    latent_dim=16, dense_ffn_dim=64, context_length=64)
SETTINGS = train.TrainConfig(steps=6, batch_size=2, seq_len=32, warmup_steps=2, eval_every=0, eval_bytes=256,
                             checkpoint_every=0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lib")
    (root / "pkg").mkdir()
    for i in range(20):
        (root / "pkg" / f"m{i}.py").write_bytes(f"def f{i}(x):\n    return x * {i} + 1\n".encode() * 8)
    return data.stdlib_corpus(root, cache=tmp_path_factory.mktemp("cache"))


def test_a_probe_run_is_the_claims_run(corpus):
    replay = claims.run_variant(MODEL, SETTINGS, seed=1, corpus=corpus, stop_after=3)
    records = probe_run(MODEL, SETTINGS, corpus, steps=3, seed=1)
    assert [r["loss"] for r in records] == replay["losses"]
    assert [r["max_violation"] for r in records] == replay["max_violation"]


def test_the_router_trace_is_recorded_for_quantile_balancing_only(corpus):
    quantile = probe_run(MODEL, SETTINGS, corpus, steps=3)
    assert "score_shift" not in quantile[0] and all("score_shift" in r for r in quantile[1:])
    assert all(0 < r["score_spread"] < 1 and 0 < r["score_max"] <= 1 for r in quantile)
    sign = probe_run(MODEL.replace(balancing="sign"), SETTINGS, corpus, steps=2)
    assert all("score_spread" not in r for r in sign)


def test_gamma_sets_the_sign_rule_step(corpus):
    """Two steps of the sign rule: the second step's routing differs once the first step's bias moved by γ."""
    sign = MODEL.replace(balancing="sign")
    small, large = (probe_run(sign, SETTINGS, corpus, steps=3, gamma=gamma) for gamma in (1e-6, 1.0))
    assert small[0]["max_violation"] == large[0]["max_violation"]
    assert [r["max_violation"] for r in small] != [r["max_violation"] for r in large]
    with pytest.raises(ValueError, match="steps"):
        probe_run(sign, SETTINGS, corpus, steps=7)


def test_a_saturated_router_cannot_be_split_by_a_bias():
    generator = torch.Generator().manual_seed(0)
    gaps = torch.tensor([-0.1, -1e-6, 1e-6, 0.1])
    unsaturated = saturated_split(torch.randn(500, 2, generator=generator), gaps)
    saturated = saturated_split(25 + torch.randn(500, 2, generator=generator), gaps)
    assert 0 < unsaturated[0] < unsaturated[1] <= unsaturated[2] < unsaturated[3] < 1
    assert saturated[1] == 0 and saturated[2] == 1  # every token scores 1.0 for both: they move all at once
    with pytest.raises(ValueError, match="logits"):
        saturated_split(torch.zeros(4, 3), gaps)
