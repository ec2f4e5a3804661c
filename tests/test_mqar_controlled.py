"""MQAR, controlled (chapter 12 §6.3): KDA's starting decays laid out three ways, one of them exactly GDN's per head;
each variant's learning rate the one tuning.py's rule picks from its saved tuning runs; the saved runs replay."""

from __future__ import annotations

import math

import pytest
import torch

from k3course.data import IGNORE, mqar
from k3course.layers.kda import DecayedLinearAttention, GatedDeltaNet, KimiDeltaAttention
from k3course.lessons import claims, experiments, tuning
from k3course.lessons.recall import DECAY_INITS, RecallModel, recall_by_pair


def _kda_starting_decays(n_heads: int, head_dim: int, lower_bound: float | None = -5.0,
                         decay_init: str | None = None) -> torch.Tensor:
    """The starting decays of a recall model's KDA layers laid out by ``decay_init`` (None: the layer's own)."""
    options = {} if decay_init is None else {"decay_init": decay_init}
    model = RecallModel(64, "KDA", d_model=n_heads * head_dim, n_layers=2, n_heads=n_heads, lower_bound=lower_bound,
                        **options)
    assert torch.equal(model.mixers[0].dt_bias, model.mixers[1].dt_bias)
    return model.mixers[1].starting_decays()

CONTROLLED = ("mqar-controlled", "mqar-controlled-8")
REPLAY_STEPS = 2


def _replayed(losses: list[float], saved: list[float]) -> None:
    """To float32 rounding, as tests/test_experiments.py replays the other saved runs."""
    assert losses == pytest.approx(saved, rel=1e-5, abs=0)


# --- the starting decays --------------------------------------------------------------------------------

@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("n_heads, head_dim", [(1, 8), (2, 16), (4, 8)])
def test_per_head_kda_starts_every_channel_at_gdns_decay_for_that_head(n_heads, head_dim, lower_bound):
    gdn = GatedDeltaNet(8, n_heads, head_dim)
    ours, theirs = _kda_starting_decays(n_heads, head_dim, lower_bound, "per_head"), gdn.starting_decays()
    assert ours.shape == theirs.shape == (n_heads, head_dim)
    assert torch.equal(ours, ours[:, :1].expand_as(ours))  # one value per head
    # the same −g (softplus of the same bias, or −5·σ(logit(−g/5)) for K3's bounded gate) to float32 rounding
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    assert torch.equal(DecayedLinearAttention(8, n_heads, head_dim).starting_decays(), theirs)
    assert theirs[0, 0].item() == pytest.approx(0.01, rel=1e-6)
    if n_heads > 1:
        assert theirs[-1, 0].item() == pytest.approx(0.5, rel=1e-6)


def test_within_heads_spans_the_whole_range_in_every_head_and_across_heads_is_the_default():
    within = _kda_starting_decays(2, 16, decay_init="within_heads")
    assert torch.equal(within[0], within[1])
    assert within[0, 0].item() == pytest.approx(0.01, rel=1e-6) and within[0, -1].item() == pytest.approx(0.5, rel=1e-6)
    assert torch.all(within[:, 1:] > within[:, :-1])
    default = KimiDeltaAttention(8, 2, 16).starting_decays()  # K3's layer: the shipped checkpoint starts here
    assert torch.equal(default, _kda_starting_decays(2, 16, decay_init="across_heads"))
    assert torch.equal(default, _kda_starting_decays(2, 16))
    assert default[0].max() < default[1].min()  # head 0 all slow, head 1 all fast
    assert torch.all(default.flatten()[1:] > default.flatten()[:-1])
    assert DECAY_INITS == ("across_heads", "per_head", "within_heads")


def test_bad_decay_init_is_a_clear_error():
    with pytest.raises(ValueError, match="decay_init must be one of"):
        RecallModel(64, "KDA", d_model=16, decay_init="per_channel")
    with pytest.raises(ValueError, match="kda_options .decay_init. apply to KDA only"):
        RecallModel(64, "GDN", d_model=16, decay_init="per_head")
    with pytest.raises(ValueError, match="kda_options must be decay_init or lower_bound"):
        RecallModel(64, "KDA", d_model=16, chunk=8)


@pytest.mark.parametrize("name", CONTROLLED)
def test_the_saved_variants_started_from_the_decays_their_layers_give_and_alike_per_head(name):
    saved = experiments.load(name)
    settings, variants = saved["settings"], saved["result"]["variants"]
    assert list(variants) == list(experiments.CONTROLLED_VARIANTS)
    for label, variant in variants.items():
        options = dict(experiments.CONTROLLED_VARIANTS[label])
        assert {key: variant[key] for key in options} == options, label
        model = RecallModel(64, options.pop("mixer"), d_model=settings["n_heads"] * settings["head_dim"],
                            n_heads=settings["n_heads"], **options)
        assert sum(variant["starting_decays"], []) == pytest.approx(sum(model.starting_decays(), []), rel=1e-6)
        assert variant["gate_lr_scale"] == settings["gate_lr_scale"]
    per_head = [sum(variants[label]["starting_decays"], []) for label in ("KDA (per head)", "GDN", "decayed linear")]
    assert all(decays == pytest.approx(per_head[0], rel=1e-6) for decays in per_head)


# --- the learning-rate rule --------------------------------------------------------------------------------

def test_tuned_lr_trains_every_rate_once_and_picks_the_lowest_tail_diverged_runs_losing():
    tails = {1e-3: 2.0, 3e-3: 1.5, 1e-2: math.nan}
    trained = []

    def fake(lr):
        trained.append(lr)
        return [4.0] * 30 + [tails[lr]] * 10

    chosen = experiments.tuned_lr(fake, [1e-2, 1e-3, 3e-3])
    assert trained == [1e-3, 3e-3, 1e-2] and chosen["lr"] == 3e-3 and chosen["lr_grid"] == [1e-3, 3e-3, 1e-2]
    assert [t["tail_loss"] for t in chosen["trials"]] == [2.0, 1.5, math.inf]
    tails.update({3e-3: 2.5, 3e-4: 1.0})  # 1e-3 wins at the bottom edge: one run at 3e-4, which ends lower
    trained.clear()
    chosen = experiments.tuned_lr(fake, [1e-2, 1e-3, 3e-3])
    assert trained == [1e-3, 3e-3, 1e-2, 3e-4] and chosen["lr"] == 3e-4 and chosen["lr_grid"] == [1e-3, 3e-3, 1e-2]
    assert [t["lr"] for t in chosen["trials"]] == [3e-4, 1e-3, 3e-3, 1e-2]
    with pytest.raises(ValueError, match="lr_grid must hold at least 3"):
        experiments.tuned_lr(fake, (1e-3, 3e-3))


@pytest.mark.parametrize("name", CONTROLLED)
def test_each_saved_rate_is_the_one_the_rule_picks_from_the_saved_tuning_runs(name):
    saved = experiments.load(name)
    result = saved["result"]
    assert result["rule"] in (tuning.RULE, tuning.RULE_WITHOUT_EXTENSION)  # saved before the run past an edge
    steps = saved["settings"]["steps"] if "steps" in saved["settings"] else saved["settings"]["train"]["steps"]
    for label, variant in result["variants"].items():
        assert variant["lr_grid"] == list(tuning.LR_GRID)
        trials = {trial["lr"]: trial["losses"] for trial in variant["trials"]}
        beyond = tuning.extension(tuning.LR_GRID, {lr: trials[lr] for lr in tuning.LR_GRID}) \
            if result["rule"] == tuning.RULE else None
        assert list(trials) == sorted([*tuning.LR_GRID, *([beyond] if beyond else [])]), label
        assert all(len(losses) == steps // tuning.TUNING_FRACTION for losses in trials.values()), label
        assert [t["tail_loss"] for t in variant["trials"]] == [tuning.tail_loss(x) for x in trials.values()]
        assert tuning.choose_lr(trials) == variant["lr"], label
        runs = [run for run in result["runs"] if run["variant"] == label]
        assert [run["seed"] for run in runs] == [0, 1, 2] and all(len(run["losses"]) == steps for run in runs)


# --- the saved runs replay --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONTROLLED)
def test_the_last_controlled_run_replays_at_its_tuned_rate(name):
    saved = experiments.load(name)
    settings, result = saved["settings"], saved["result"]
    last = result["runs"][-1]
    train = experiments.recall_settings(settings["steps"], settings["batch_size"], settings["warmup_steps"],
                                        settings["gate_lr_scale"])
    train = train.replace(lr=result["variants"][last["variant"]]["lr"], seed=last["seed"])
    with experiments.torch_threads(result["torch_threads"]):
        replay = experiments.controlled_run(last["variant"], train, settings["n_pairs"], settings["head_dim"],
                                            settings["n_heads"], stop_after=REPLAY_STEPS)
    _replayed(replay["losses"], last["losses"][:REPLAY_STEPS])


def test_the_depth_variants_differ_in_depth_only_and_their_8_layer_runs_are_the_hybrid_schedules_all_kda():
    """mqar-depth (a claim, replayed with the others in test_experiments) changes only the depth of hybrid-mqar's
    all-KDA K3; its 8-layer runs and tuning runs are hybrid-mqar's, copied, not trained again."""
    two, eight = claims.depth_variants().values()
    assert two == eight.replace(n_layers=2) and eight == claims.hybrid_variants()["all-KDA"]
    depth, hybrid = experiments.load("mqar-depth"), experiments.load("hybrid-mqar")
    assert depth["settings"]["train"] == hybrid["settings"]["train"] and depth["settings"]["task"] == "mqar"
    copied = [run for run in depth["result"]["runs"] if run["variant"] == "K3 all-KDA, 8 layers"]
    originals = [run for run in hybrid["result"]["runs"] if run["variant"] == "all-KDA"]
    assert [run["reused_from"] for run in copied] == ["hybrid-mqar: all-KDA"] * 3
    assert [run["losses"] for run in copied] == [run["losses"] for run in originals]
    # the same tuning runs, each trained once: the grid's by hybrid-mqar, the run past its bottom edge by mqar-depth
    # (re-run first under the extended rule), each copied by the other
    depth_trials = depth["result"]["tuning"]["trials"]["K3 all-KDA, 8 layers"]
    hybrid_trials = hybrid["result"]["tuning"]["trials"]["all-KDA"]
    unsourced = lambda trials: [{k: v for k, v in trial.items() if k != "reused_from"} for trial in trials]
    assert unsourced(depth_trials) == unsourced(hybrid_trials)
    sources = lambda trials: {trial["lr"]: trial.get("reused_from", "") for trial in trials}
    past_edge = min(sources(depth_trials))
    assert sources(hybrid_trials)[past_edge] == "mqar-depth: K3 all-KDA, 8 layers (tuning)"
    assert all(source == "hybrid-mqar: all-KDA (tuning)" for lr, source in sources(depth_trials).items()
               if lr != past_edge)


# --- what recall_run adds ---------------------------------------------------------------------------------

class _Oracle(torch.nn.Module):
    """Logits whose arg-max is the stored value at the queries of the pairs written last (``newest`` of them)."""

    def __init__(self, n_pairs: int, newest: int):
        super().__init__()
        self.n_pairs, self.newest = n_pairs, newest

    def forward(self, tokens):
        written = tokens[:, 0:2 * self.n_pairs:2]
        logits = torch.zeros(*tokens.shape, 64)
        for row, col in zip(*torch.nonzero(tokens[:, 2 * self.n_pairs:] > 0, as_tuple=True)):
            col = col + 2 * self.n_pairs
            index = (written[row] == tokens[row, col]).nonzero().item()
            if index >= self.n_pairs - self.newest:
                logits[row, col, tokens[row, 2 * index + 1]] = 1.0
        return logits


def test_recall_by_pair_scores_each_pair_by_its_write_order():
    tokens, targets = mqar(16, seq_len=64, n_pairs=20, vocab_size=64, seed=3)
    assert (targets != IGNORE).sum() == 16 * 20
    assert recall_by_pair(_Oracle(20, 20), tokens, targets, 20) == [1.0] * 20
    assert recall_by_pair(_Oracle(20, 5), tokens, targets, 20) == [0.0] * 15 + [1.0] * 5


def test_the_gate_learning_rate_scale_moves_only_the_gate_parameters_steps():
    settings = experiments.recall_settings(steps=4, batch_size=2, warmup_steps=1).replace(lr=3e-3, seed=0)
    options = dict(d_model=16, n_heads=2, n_pairs=4, stop_after=3)
    same = experiments.recall_run("KDA", settings, **options)
    scaled = experiments.recall_run("KDA", settings.replace(gate_lr_scale=10.0), **options)
    assert scaled["losses"][0] == same["losses"][0] and scaled["losses"][2] != same["losses"][2]
    assert sum(same["starting_decays"], []) == pytest.approx([0.01, 0.0621, 0.0806, 0.5], rel=2e-3)


def test_tuned_variants_table_shows_the_decays_each_rates_tail_loss_the_choice_starred_and_the_accuracy():
    trials = [{"lr": lr, "tail_loss": tail, "losses": []} for lr, tail in zip((1e-3, 1e-2), (2.5, 1.25))]
    result = {"variants": {"GDN": {"lr_grid": [1e-3, 1e-2], "trials": trials, "lr": 1e-2,
                                   "starting_decays": [[0.01, 0.01], [0.5, 0.5]]},
                           "KDA": {"lr_grid": [1e-3, 1e-2], "trials": trials, "lr": 1e-3,
                                   "starting_decays": [[0.01, 0.062], [0.081, 0.5]]}},
              "runs": [{"variant": "GDN", "accuracy": 0.5}, {"variant": "GDN", "accuracy": 0.75},
                       {"variant": "KDA", "accuracy": 0.25}]}
    header, gdn, kda = experiments.tuned_variants_table(result).splitlines()
    assert "lr 0.001" in header and "lr 0.01" in header
    assert gdn.split()[1:] == ["0.01", "0.5", "2.500", "1.250*", "0.625", "[0.500,", "0.750]"]
    assert kda.split()[1:5] == ["0.01–0.062", "0.081–0.5", "2.500*", "1.250"]
