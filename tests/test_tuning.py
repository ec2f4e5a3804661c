"""Tuned alike (chapter 12): the learning-rate rule, fixed before the runs, on fake tuning runs."""

from __future__ import annotations

import math

import pytest

from k3course.lessons import claims, experiments, tuning
from k3course.train import TrainConfig


@pytest.fixture(autouse=True)
def _own_finished_runs(tmp_path, monkeypatch):
    """Each test keeps the runs it trains in its own folder (an experiment's finished runs are taken back by the
    next invocation: a test must not take another's)."""
    monkeypatch.setattr(experiments, "FINISHED_RUNS", tmp_path / "finished-runs")


def test_the_rule_picks_the_lowest_mean_loss_over_the_last_tenth_not_the_last_step():
    # 20 steps: the tail is the last 2. 1e-2 ends lowest on its very last step but higher on average.
    trials = {1e-3: [3.0] * 18 + [2.0, 2.0], 3e-3: [3.0] * 18 + [1.9, 1.95], 1e-2: [3.0] * 18 + [2.5, 1.0]}
    assert tuning.tail_loss(trials[3e-3]) == pytest.approx(1.925)
    assert tuning.choose_lr(trials) == 1e-2  # tail mean 1.75
    trials[1e-2] = [3.0] * 18 + [2.9, 1.0]  # tail mean 1.95: loses to 3e-3 although its last loss is the lowest
    assert tuning.choose_lr(trials) == 3e-3


def test_a_diverged_run_never_wins_and_ties_go_to_the_smaller_rate():
    assert tuning.tail_loss([1.0, math.nan, 0.1]) == math.inf  # a NaN anywhere: the run diverged
    assert tuning.choose_lr({1e-3: [2.0, 1.5], 3e-3: [2.0, float("inf")], 1e-2: [2.0, math.nan]}) == 1e-3
    assert tuning.choose_lr({3e-3: [1.0], 1e-3: [1.0], 1e-2: [1.0]}) == 1e-3
    with pytest.raises(ValueError, match="every run diverged"):
        tuning.choose_lr({1e-3: [math.nan], 3e-3: [math.inf], 1e-2: [math.nan]})
    with pytest.raises(ValueError, match="losses must hold at least one"):
        tuning.tail_loss([])


def test_the_tuning_run_is_seed_0_for_a_quarter_of_the_steps_with_its_warmup_scaled():
    short = tuning.tuning_settings(TrainConfig(steps=800, warmup_steps=50, seed=3, lr=3e-3))
    assert (short.steps, short.warmup_steps, short.seed, short.batch_size, short.seq_len) == (200, 12, 0, 16, 128)
    assert tuning.tuning_settings(TrainConfig(steps=2, warmup_steps=1)).steps == 1


def test_an_edge_winner_extends_the_grid_one_step_an_interior_one_does_not():
    grid = tuning.LR_GRID
    assert tuning.grid_step(grid) == pytest.approx(10 ** 0.5)
    assert tuning.extension(grid, {1e-3: [2.0], 3e-3: [1.5], 1e-2: [1.0]}) == 3e-2  # top edge: × √10, one figure
    assert tuning.extension(grid, {1e-3: [1.0], 3e-3: [1.5], 1e-2: [2.0]}) == 3e-4  # bottom edge: ÷ √10
    assert tuning.extension(grid, {1e-3: [2.0], 3e-3: [1.0], 1e-2: [1.5]}) is None
    assert tuning.extension(grid, {1e-3: [1.0], 3e-3: [1.0], 1e-2: [math.nan]}) == 3e-4  # the tie went to 1e-3
    assert tuning.extension((1e-4, 1e-3, 1e-2, 1e-1), {1e-4: [3.0], 1e-3: [2.0], 1e-2: [1.5], 1e-1: [1.0]}) == 1.0
    assert "one more run one grid step past it" in tuning.RULE and tuning.RULE.startswith(
        tuning.RULE_WITHOUT_EXTENSION)


def test_the_grid_needs_three_distinct_positive_rates():
    assert tuning.check_grid((1e-2, 1e-3, 3e-3)) == (1e-3, 3e-3, 1e-2)
    for bad in ((1e-3, 3e-3), (1e-3, 1e-3, 3e-3), (1e-3, 0.0, 3e-3), "1e-3", (1e-3, 3e-3, True)):
        with pytest.raises(ValueError, match="lr_grid must hold at least 3 distinct positive"):
            tuning.check_grid(bad)


def test_tune_learning_rates_applies_the_rule_to_the_trials_it_trains(monkeypatch, tmp_path):
    """With training faked (each rate's losses a function of the rate), the chosen rate is the rule's, per variant,
    and every trial is recorded with its tail loss."""
    monkeypatch.setattr(experiments, "RESULTS", tmp_path)  # no saved run to copy

    def fake_train(label, cfg, settings, seed, task, prompt, device, stop_after=None):
        assert seed == 0 and stop_after == settings.steps == 5
        best = {"a": 3e-3, "b": 1e-2}[label]
        return {"variant": label, "seed": seed, "losses": [5.0] * 4 + [abs(math.log(settings.lr / best))],
                "seconds": 0.0}

    monkeypatch.setattr(experiments, "_train_variant", fake_train)
    variants = {"a": claims.SMALL, "b": claims.SMALL.replace(balancing="sign")}
    tuned = experiments.tune_learning_rates(variants, TrainConfig(steps=20, warmup_steps=4), "text", tuning.LR_GRID,
                                            jobs=1, device="cpu")
    assert tuned["chosen"] == {"a": 3e-3, "b": 1e-2} and tuned["grid"] == list(tuning.LR_GRID)
    assert [t["lr"] for t in tuned["trials"]["a"]] == list(tuning.LR_GRID)  # interior winner: no extension
    # b won at the top edge: one more run at 3e-2, which ends higher, so 1e-2 stays
    assert [t["lr"] for t in tuned["trials"]["b"]] == [*tuning.LR_GRID, 3e-2] and tuned["extended"] == {"b": 3e-2}
    assert tuned["trials"]["b"][2]["tail_loss"] == 0.0 and tuned["settings"]["steps"] == 5


@pytest.mark.parametrize("best, tail_at_the_extension, chosen", [(1e-1, 0.0, 3e-2), (1e-1, math.nan, 1e-2),
                                                                 (1e-4, 0.0, 3e-4), (1e-4, math.inf, 1e-3)])
def test_the_extension_wins_when_it_ends_lower_and_never_when_it_diverged(monkeypatch, tmp_path, best,
                                                                        tail_at_the_extension, chosen):
    monkeypatch.setattr(experiments, "RESULTS", tmp_path)  # no saved run to copy
    trained = []

    def fake_train(label, cfg, settings, seed, task, prompt, device, stop_after=None):
        trained.append(settings.lr)
        tail = tail_at_the_extension if settings.lr not in tuning.LR_GRID else abs(math.log(settings.lr / best))
        return {"variant": label, "seed": seed, "losses": [5.0] * 4 + [tail], "seconds": 0.0}

    monkeypatch.setattr(experiments, "_train_variant", fake_train)
    tuned = experiments.tune_learning_rates({"a": claims.SMALL}, TrainConfig(steps=20, warmup_steps=4), "text",
                                            tuning.LR_GRID, jobs=1, device="cpu")
    beyond = 3e-2 if best > 1e-2 else 3e-4
    assert trained == [*tuning.LR_GRID, beyond] and tuned["extended"] == {"a": beyond}
    assert tuned["chosen"] == {"a": chosen} and [t["lr"] for t in tuned["trials"]["a"]] == sorted(trained)


def test_the_quoted_tuning_loss_is_the_saved_trials_and_names_the_grid_for_a_rate_never_tried():
    from k3course.lessons.quoted import claims as quoted_claims
    from k3course.lessons.quoted import tuning as quoted_tuning

    trials = experiments.load("mqar-depth")["result"]["tuning"]["trials"]["K3 all-KDA, 8 layers"]
    assert quoted_tuning.claim_tuning_loss("mqar-depth", "K3 all-KDA, 8 layers", 1e-3) == \
        next(trial["tail_loss"] for trial in trials if trial["lr"] == 1e-3)
    # the grid and its run past the bottom edge
    with pytest.raises(KeyError, match=r"tuned at \[0.0003, 0.001, 0.003, 0.01\]"):
        quoted_tuning.claim_tuning_loss("mqar-depth", "K3 all-KDA, 8 layers", 5e-3)
    # one variant's runs, in minutes: the 8-layer stack takes longer than the 2-layer one
    two, eight = (quoted_claims.claim_minutes("mqar-depth", f"K3 all-KDA, {n} layers") for n in (2, 8))
    assert two.second < eight.first
    with pytest.raises(KeyError, match="variant: mqar-depth has no runs of 'all-KDA'"):
        quoted_claims.claim_minutes("mqar-depth", "all-KDA")


def test_the_saved_horizon_check_trains_each_variant_at_full_length_at_every_rate_its_tuning_tried():
    """tuning-horizon: per variant of its claim, a seed-0 run of the claim's full settings at each rate the tuning
    ran at (the one at the chosen rate is the claim's own seed-0 run), and the rates that end lowest, recomputed;
    its last run replays."""
    saved = experiments.load("tuning-horizon")
    result = saved["result"]
    claim = experiments.load(result["claim_result"])
    full = experiments.train_config(claim["settings"]["train"])
    variants = claims.CLAIMS[claim["settings"]["claim"]]()
    assert list(result["variants"]) == list(variants)
    for label, record in result["variants"].items():
        tried = [trial["lr"] for trial in claim["result"]["tuning"]["trials"][label]]
        runs = [run for run in result["runs"] if run["variant"] == label]
        assert [run["lr"] for run in runs] == [row["lr"] for row in record["full"]] == tried
        assert all(run["seed"] == 0 and len(run["losses"]) == full.steps for run in runs)
        assert [row["val_bpb"] for row in record["full"]] == [run["val_bpb"] for run in runs]
        assert [row["tail_loss"] for row in record["full"]] == [tuning.tail_loss(run["losses"]) for run in runs]
        assert record["chosen"] == claim["result"]["tuning"]["chosen"][label]
        for measure in ("val_bpb", "tail_loss"):
            assert record[f"lowest_{measure}"] == min(record["full"], key=lambda row: row[measure])["lr"]
        own = next(run for run in claim["result"]["runs"] if run["variant"] == label and run["seed"] == 0)
        at_chosen = next(run for run in runs if run["lr"] == record["chosen"])
        assert at_chosen["losses"] == own["losses"] and at_chosen["val_bpb"] == own["val_bpb"]
    last = result["runs"][-1]
    with experiments.torch_threads(result["torch_threads"]):
        replay = claims.run_variant(variants[last["variant"]], full.replace(lr=last["lr"]), 0, "text", stop_after=2)
    assert replay["losses"] == pytest.approx(last["losses"][:2], rel=1e-5, abs=0)
