"""Chapter 12's experiments: the saved results come from this code, and each claim's variants differ as stated."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from k3course import accounting, baselines, checkpoint, data, train
from k3course.cli import main
from k3course.config import K3Config
from k3course.device import machine
from k3course.lessons import claims, experiments, seed_statistics, tuning
from k3course.train.config import train_preset

CLAIM_EXPERIMENTS = [name for name, (function, _) in experiments.EXPERIMENTS.items()
                     if function is experiments.claim_variants]
SAVED = [name for name in experiments.EXPERIMENTS if (experiments.RESULTS / f"{name}.json").exists()]
REPLAY_STEPS = 2


@pytest.fixture(autouse=True)
def _own_finished_runs(tmp_path, monkeypatch):
    """Each test keeps the runs it trains in its own folder (an experiment's finished runs are taken back by the
    next invocation: a test must not take another's)."""
    monkeypatch.setattr(experiments, "FINISHED_RUNS", tmp_path / "finished-runs")


def _same_except(configs: dict[str, K3Config], allowed: set[str]) -> None:
    """Every config equals the first one in every field outside ``allowed`` (and ``name``)."""
    first, *rest = configs.values()
    for other in rest:
        differ = {f.name for f in dataclasses.fields(K3Config) if getattr(first, f.name) != getattr(other, f.name)}
        assert differ <= allowed | {"name"}, differ - allowed


def _replayed(losses: list[float], saved: list[float], saved_machine: str) -> None:
    """To float32 rounding (1e-5 relative): bit-exact equality held on the saving machine when each run was made,
    but later speed-ups of the KDA chunk and MoE code (same maths, other summation order) move the last bits."""
    assert losses == pytest.approx(saved, rel=1e-5, abs=0), (saved_machine, machine())


# --- the command ------------------------------------------------------------------------------------------

def test_unknown_experiment_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="name: unknown experiment 'nope'.*balancing"):
        experiments.run_experiment("nope")
    assert main(["experiments", "nope"]) == 2
    assert "mqar-mixers" in capsys.readouterr().err


def test_every_experiment_has_a_saved_result_made_by_its_command_with_its_settings():
    assert SAVED == list(experiments.EXPERIMENTS)
    for name, (_, settings) in experiments.EXPERIMENTS.items():
        saved = experiments.load(name)
        assert saved["command"] == f"k3course experiments {name}"
        # training settings saved before a TrainConfig field was added have it at its default
        plain = lambda given: {k: experiments.train_config(v) if k == "train" else v
                               for k, v in json.loads(json.dumps(given)).items()}
        assert plain(saved["settings"]) == plain(settings), name


def test_jobs_train_the_same_runs_in_worker_processes():
    """--jobs N trains runs in spawned processes: the runs, their order and every number are those of one."""
    budget = dataclasses.asdict(train.TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=1, eval_every=0,
                                                  eval_bytes=256, checkpoint_every=0))
    one, two = (experiments.claim_variants("balancing", (0,), "text", budget, jobs=jobs) for jobs in (1, 2))
    drop_time = lambda result: [{k: v for k, v in run.items() if k != "seconds"} for run in result["runs"]]
    assert [run["variant"] for run in two["runs"]] == list(claims.balancing_variants())
    assert drop_time(two) == drop_time(one)


def test_jobs_is_checked_and_only_for_claim_experiments():
    with pytest.raises(ValueError, match="jobs must be an int ≥ 1, got 0"):
        experiments.run_experiment("balancing", jobs=0)
    with pytest.raises(ValueError, match="jobs: tiny-default runs in one process"):
        experiments.run_experiment("tiny-default", jobs=2)


def test_the_gpu_budget_is_the_four_text_claims_on_cuda_at_their_own_training_settings():
    for name in experiments.GPU_CLAIMS:
        settings = experiments.budget_settings(name, "gpu")
        assert settings["device"] == "cuda" and settings["train"] == dataclasses.asdict(experiments.GPU_TEXT_TRAIN)
        assert {k: v for k, v in settings.items() if k not in ("train", "device", "lr_grid")} == \
            {k: v for k, v in experiments.EXPERIMENTS[name][1].items() if k not in ("train", "lr_grid")}
        assert settings["lr_grid"] == tuning.LR_GRID  # tuned alike on the GPU too
        assert experiments.result_name(name, "gpu") == f"{name}-gpu"
    assert experiments.budget_settings("balancing") is experiments.EXPERIMENTS["balancing"][1]
    with pytest.raises(ValueError, match="budget: balancing has no GPU budget"):
        experiments.budget_settings("balancing", "gpu")
    with pytest.raises(ValueError, match="budget must be one of default, gpu, got 'tpu'"):
        experiments.budget_settings("hybrid-ratio-default", "tpu")


def test_the_gpu_budget_is_about_1_8_gpu_hours_by_the_step_times_measured_on_an_h200():
    measured = json.loads((experiments.RESULTS / "gpu_budget.json").read_text())
    assert (measured["batch_size"], measured["seq_len"]) == (experiments.GPU_TEXT_TRAIN.batch_size,
                                                             experiments.GPU_TEXT_TRAIN.seq_len)
    assert set(measured["step_ms"]) == set(experiments.GPU_CLAIMS)
    assert 1.6 <= experiments.gpu_budget_hours(measured["step_ms"], experiments.GPU_TEXT_TRAIN) <= 2.0
    # by hand: latent-moe's three variants × (their seeds: 5 for the pair within reach, 3 for the published latent,
    # + 3 tuning runs of a quarter of the steps), the unmeasured ones at the claim's mean; every other claim free
    step_ms = {**{name: {"free": 0.0} for name in experiments.GPU_CLAIMS}, "latent-moe-default": {"full width": 100.0}}
    hours = experiments.gpu_budget_hours(step_ms, experiments.GPU_TEXT_TRAIN.replace(steps=3600))
    assert hours == pytest.approx(0.1 * (2 * (5 + 3 / 4) + (3 + 3 / 4)))
    # a config two claims train (residuals' Block AttnRes is hybrid-ratio's 3:1, five seeds in both) is counted once
    zero = lambda claim, measured: {**dict.fromkeys(claims.CLAIMS[claim](), 0.0), **measured}
    shared = {**{name: {"free": 0.0} for name in experiments.GPU_CLAIMS},
              "residuals-default": zero("residuals", {"Block AttnRes": 1e3}),
              "hybrid-ratio-default": zero("hybrid-ratio", {"3:1": 1e3})}
    assert experiments.gpu_budget_hours(shared, experiments.GPU_TEXT_TRAIN.replace(steps=3600)) == \
        pytest.approx(5 + 3 / 4)


def test_the_gpu_budget_needs_a_gpu_or_a_device_named_and_checks_the_device(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="budget: 'gpu' trains on a CUDA GPU"):
        experiments.run_experiment("latent-moe-default", budget="gpu")
    with pytest.raises(ValueError, match="device must be a CPU or CUDA torch device.*'meta'"):
        experiments.run_experiment("latent-moe-default", budget="gpu", device="meta")
    with pytest.raises(ValueError, match="device: mqar-sweep trains on the CPU"):
        experiments.run_experiment("mqar-sweep", device="cpu")
    assert main(["experiments", "latent-moe-default", "--budget", "gpu"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_the_gpu_budget_smoke_tested_on_the_cpu_for_two_steps(tmp_path, monkeypatch):
    """Every GPU-budget claim, in the order a GPU would run them (residuals copies hybrid-ratio's 3:1 runs), for 4
    steps on the CPU (tuning runs of 1) of batches 4 × 64 (GPU_TEXT_TRAIN's 32 × 256 cost minutes here and test
    nothing more): each run trains, evaluates and is saved as NAME-gpu.json."""
    monkeypatch.setattr(experiments, "RESULTS", tmp_path)
    monkeypatch.setattr(experiments, "GPU_TEXT_TRAIN", experiments.GPU_TEXT_TRAIN.replace(
        steps=4, warmup_steps=2, eval_bytes=2048, batch_size=4, seq_len=64))
    for name in ("hybrid-ratio-default", "residuals-default", "latent-moe-default", "dense-baseline-default"):
        settings = {**experiments.EXPERIMENTS[name][1], "seeds": (0,), "more_seeds": None}
        monkeypatch.setitem(experiments.EXPERIMENTS, name, (experiments.claim_variants, settings))
        path = experiments.run_experiment(name, budget="gpu", device="cpu")
        assert path == tmp_path / f"{name}-gpu.json"
        saved = json.loads(path.read_text())
        assert saved["command"] == f"k3course experiments {name} --budget gpu" and saved["settings"]["device"] == "cpu"
        runs = saved["result"]["runs"]
        assert {run["variant"] for run in runs} >= set(claims.CLAIMS[settings["claim"]]())
        assert all(math.isfinite(run["val_bpb"]) and len(run["losses"]) == run.get("steps", 4) for run in runs)
    reused = [run for run in experiments.load("residuals-default-gpu")["result"]["runs"] if "reused_from" in run]
    assert [run["reused_from"] for run in reused] == ["hybrid-ratio-default-gpu: 3:1"]  # the same run, copied


# --- the MQAR sweep ----------------------------------------------------------------------------------------

def test_sweep_cells_have_more_pairs_than_head_channels_cheapest_first():
    cells = experiments.sweep_cells(steps=(100, 300), n_pairs=(8, 20), head_dims=(8, 16))
    assert all(cell["n_pairs"] > cell["head_dim"] for cell in cells)
    assert cells[0] == {"steps": 100, "n_pairs": 20, "head_dim": 8}  # cheapest, and the harder task first
    costs = [cell["steps"] * cell["head_dim"] for cell in cells]
    assert costs == sorted(costs) and len(cells) == 2 * 2  # (20 pairs) × (8, 16 channels) × 2 step counts


def test_the_sweep_stops_at_the_first_cell_a_mixer_solves_in_most_seeds(monkeypatch):
    """A fake recall run: KDA solves every seed from 300 steps, and only seed 0 at 200 steps (1 of 3: the walk
    goes on)."""
    def fake_run(mixer, settings, d_model, n_heads, n_pairs=20, stop_after=None):
        steps, seed = settings.steps, settings.seed
        solved = mixer == "KDA" and (steps >= 300 or (steps == 200 and seed == 0))
        return {"losses": [0.0], "accuracy": 1.0 if solved else 0.05, "seconds": 0.0}
    monkeypatch.setattr(experiments, "recall_run", fake_run)
    settings = dict(n_pairs=(20,), head_dims=(8,), batch_size=2, lr=1e-3, warmup_steps=1, n_heads=2,
                    seeds=(0, 1, 2), solved=0.9)
    result = experiments.mqar_sweep(steps=(100, 200, 300, 400), **settings)
    assert [cell["steps"] for cell in result["cells"]] == [100, 200, 300] and result["chosen"] == 2
    assert len(result["cells"][0]["runs"]) == len(experiments.MIXERS)  # no mixer solved seed 0: one seed only
    assert experiments.solved_seeds(result["cells"][1]["runs"], "KDA", 0.9) == 1  # seed 0 solved: all seeds ran
    assert len(result["cells"][1]["runs"]) == 3 * len(experiments.MIXERS)
    comparison = experiments.sweep_comparison(result)
    assert seed_statistics.spread(comparison, "accuracy", "mixer")["KDA"]["mean"] == 1.0
    assert experiments.mqar_sweep(steps=(100,), **settings)["chosen"] is None
    with pytest.raises(ValueError, match="no cell"):
        experiments.sweep_comparison(experiments.mqar_sweep(steps=(100,), **settings))


def test_sweep_table_has_a_row_per_cell_tried_with_seed_0_and_marks_the_chosen_one():
    run = lambda mixer, seed, accuracy: {"mixer": mixer, "seed": seed, "accuracy": accuracy}
    result = {"cells": [{"steps": 100, "n_pairs": 20, "head_dim": 8,
                         "runs": [run("KDA", 0, 0.05), run("GDN", 0, 0.04)]},
                        {"steps": 300, "n_pairs": 20, "head_dim": 8,
                         "runs": [run("KDA", 0, 0.95), run("GDN", 0, 0.50), run("KDA", 1, 0.10)]}], "chosen": 1}
    header, first, second = experiments.sweep_table(result).splitlines()
    assert header.split()[4:6] == ["KDA", "GDN"]
    assert first.split() == ["100", "20", "8", "0.050", "0.040"]
    assert second.split()[:5] == ["300", "20", "8", "0.950", "0.500"] and second.endswith("chosen")


def test_the_saved_sweep_chose_a_cell_by_its_rule_and_its_chosen_runs_replay():
    saved = experiments.load("mqar-sweep")
    result, settings = saved["result"], saved["settings"]
    cells = result["cells"]
    assert [{k: c[k] for k in ("steps", "n_pairs", "head_dim")} for c in cells] == experiments.sweep_cells(
        settings["steps"], settings["n_pairs"], settings["head_dims"])[:len(cells)]
    most = lambda runs: max(experiments.solved_seeds(runs, m, settings["solved"]) for m in experiments.MIXERS)
    assert all(2 * most(cell["runs"]) <= len(settings["seeds"]) for cell in cells[:-1])
    if result["chosen"] is not None:
        chosen = cells[result["chosen"]]
        assert result["chosen"] == len(cells) - 1 and 2 * most(chosen["runs"]) > len(settings["seeds"])
        assert {(run["mixer"], run["seed"]) for run in chosen["runs"]} == \
            {(m, s) for m in experiments.MIXERS for s in settings["seeds"]}
    last = cells[-1]["runs"][-1]
    options = {k: settings[k] for k in ("batch_size", "lr", "warmup_steps", "n_heads")}
    with experiments.torch_threads(result["torch_threads"]):
        replay = experiments.cell_run(cells[-1], last["mixer"], last["seed"], stop_after=REPLAY_STEPS, **options)
    _replayed(replay["losses"], last["losses"][:REPLAY_STEPS], saved["machine"])


def test_load_of_a_missing_result_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(experiments, "RESULTS", tmp_path)
    with pytest.raises(FileNotFoundError, match="k3course experiments balancing"):
        experiments.load("balancing")


# --- each saved claim replays, and its variants are today's configs ----------------------------------------

@pytest.mark.parametrize("name", CLAIM_EXPERIMENTS)
def test_a_saved_claim_run_replays_and_its_variants_are_the_current_configs(name):
    """The last saved run (last variant, last seed) re-run for its first steps gives its saved losses and
    max-violations; the saved configs are the ones :mod:`k3course.lessons.claims` builds now."""
    saved = experiments.load(name)
    settings, result = saved["settings"], saved["result"]
    variants = claims.CLAIMS[settings["claim"]]()
    if settings.get("equal_time"):  # the faster variant again, for the slower one's wall time
        slower, faster = settings["equal_time"]
        variants[experiments.equal_time_label(faster)] = variants[faster]
    assert list(result["variants"]) == list(variants)
    for label, cfg in variants.items():
        saved_facts, facts = dict(result["variants"][label]), json.loads(json.dumps(experiments.describe(cfg)))
        # a config saved before a field was added has it at its default
        assert K3Config.from_dict(saved_facts.pop("config")) == cfg, label
        assert saved_facts == {k: v for k, v in facts.items() if k != "config"}, label
    steps = settings["train"]["steps"]
    for run in result["runs"]:
        assert len(run["losses"]) == len(run["max_violation"]) == run.get("steps", steps)
        assert all(math.isfinite(x) for x in run["losses"])
        assert 0 < run["val_bpb"] < 8 if settings["task"] == "text" else 0 <= run["accuracy"] <= 1
    seeds = experiments.variant_seeds(variants, settings["seeds"], settings.get("more_seeds"))
    assert [(r["variant"], r["seed"]) for r in result["runs"]] == \
        [(label, seed) for label in variants for seed in seeds[label]]
    last = result["runs"][-1]
    # each variant's own settings when tuned alike; a result at one rate (saved before tuning) has one for all
    trained = experiments.train_config(result.get("training", {}).get(last["variant"], settings)["train"])
    with experiments.torch_threads(result["torch_threads"]):
        replay = claims.run_variant(variants[last["variant"]], trained, last["seed"], settings["task"],
                                    stop_after=REPLAY_STEPS)
    _replayed(replay["losses"], last["losses"][:REPLAY_STEPS], saved["machine"])
    assert replay["max_violation"] == pytest.approx(last["max_violation"][:REPLAY_STEPS], abs=1e-6)


def test_a_saved_run_is_found_by_everything_it_is_a_function_of_and_nothing_else():
    """saved_runs: residuals-default's Block AttnRes at its chosen rate is hybrid-ratio-default's 3:1 run (the same
    config); another rate, seed, task, device or config is not found; a found run is copied with its source named."""
    saved = experiments.saved_runs()
    training = experiments.load("hybrid-ratio-default")["result"]["training"]["3:1"]
    settings = experiments.train_config(training["train"])
    block = claims.residual_variants()["Block AttnRes"]
    key = experiments.run_key(block, settings, 1, "text", "cpu", None)
    run, source = saved[key]
    assert source in ("hybrid-ratio-default: 3:1", "residuals-default: Block AttnRes") and run["seed"] == 1
    other_lr = next(lr for lr in tuning.LR_GRID if lr != settings.lr)
    for changed in (experiments.run_key(block, settings.replace(lr=other_lr), 1, "text", "cpu", None),
                    experiments.run_key(block, settings, 7, "text", "cpu", None),
                    experiments.run_key(block, settings, 1, "mqar", "cpu", None),
                    experiments.run_key(block, settings, 1, "text", "cuda", None),
                    experiments.run_key(block, settings, 1, "text", "cpu", 5),
                    experiments.run_key(block.replace(n_routed_experts=5), settings, 1, "text", "cpu", None)):
        assert changed not in saved
    # seeds 0-2 trained first as hybrid-ratio-default's 3:1; the two more seeds of the pair first as residuals-default's
    residuals = experiments.load("residuals-default")["result"]["runs"]
    hybrid = experiments.load("hybrid-ratio-default")["result"]["runs"]
    assert [r.get("reused_from") for r in residuals if r["variant"] == "Block AttnRes"] == \
        ["hybrid-ratio-default: 3:1"] * 3 + [None] * 2
    assert [r.get("reused_from") for r in hybrid if r["variant"] == "3:1"][3:] == \
        ["residuals-default: Block AttnRes"] * 2


def test_an_interrupted_experiment_takes_back_its_finished_runs_and_trains_only_the_rest(monkeypatch):
    """Runs are kept as they finish: stopped after two of its three runs, a claim trains only the third when called
    again, and returns what one uninterrupted call returns."""
    budget = dataclasses.asdict(train.TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=1, eval_every=0,
                                                  eval_bytes=256, checkpoint_every=0))
    trained, train_variant = [], experiments._train_variant

    def stopped_after_two(*job):
        if len(trained) == 2:
            raise KeyboardInterrupt  # as Ctrl-C would stop it
        trained.append(job[0])
        return train_variant(*job)

    monkeypatch.setattr(experiments, "_train_variant", stopped_after_two)
    with pytest.raises(KeyboardInterrupt):
        experiments.claim_variants("balancing", (0,), "text", budget)
    labels = list(claims.balancing_variants())
    assert trained == labels[:2] and len(list(experiments.FINISHED_RUNS.glob("*.json"))) == 2
    trained.clear()
    resumed = experiments.claim_variants("balancing", (0,), "text", budget)
    assert trained == labels[2:]
    monkeypatch.setattr(experiments, "_train_variant", train_variant)
    monkeypatch.setattr(experiments, "FINISHED_RUNS", experiments.FINISHED_RUNS.parent / "elsewhere")
    straight = experiments.claim_variants("balancing", (0,), "text", budget)
    drop_time = lambda result: [{k: v for k, v in run.items() if k != "seconds"} for run in result["runs"]]
    assert drop_time(resumed) == drop_time(straight)


def test_a_copied_run_is_not_trained_again(monkeypatch, tmp_path):
    """claim_variants trains only the runs no saved result holds: a second identical call trains nothing."""
    monkeypatch.setattr(experiments, "RESULTS", tmp_path)
    budget = dataclasses.asdict(train.TrainConfig(steps=4, batch_size=2, seq_len=16, warmup_steps=2, eval_every=0,
                                                  eval_bytes=256, checkpoint_every=0))
    monkeypatch.setitem(experiments.EXPERIMENTS, "balancing", (experiments.claim_variants, {
        "claim": "balancing", "seeds": (0,), "task": "text", "train": budget, "lr_grid": tuning.LR_GRID}))
    first = json.loads(experiments.run_experiment("balancing").read_text())["result"]
    assert not any("reused_from" in run for run in first["runs"])
    trained = []
    monkeypatch.setattr(experiments, "_train_variant", lambda *job: trained.append(job))
    second = experiments.claim_variants("balancing", (0,), "text", budget, lr_grid=tuning.LR_GRID)
    assert trained == []
    assert [r["losses"] for r in second["runs"]] == [r["losses"] for r in first["runs"]]
    labels = claims.balancing_variants()
    assert {r["reused_from"] for r in second["runs"]} == {f"balancing: {label}" for label in labels}
    assert second["tuning"]["chosen"] == first["tuning"]["chosen"]


def test_the_saved_mqar_run_replays():
    saved = experiments.load("mqar-mixers")
    result, settings = saved["result"], dict(saved["settings"])
    assert result["task"] == claims.MQAR_TASK
    assert result["task"]["n_pairs"] > settings["d_model"] // settings["n_heads"]  # more pairs than a head's dims
    assert {r["mixer"] for r in result["runs"]} == set(experiments.MIXERS)
    last = result["runs"][-1]
    train = experiments.recall_settings(settings["steps"], settings["batch_size"], settings["warmup_steps"])
    train = train.replace(lr=settings["lr"], seed=last["seed"])
    with experiments.torch_threads(result["torch_threads"]):
        replay = experiments.recall_run(last["mixer"], train, settings["d_model"], settings["n_heads"],
                                        stop_after=REPLAY_STEPS)
    _replayed(replay["losses"], last["losses"][:REPLAY_STEPS], saved["machine"])


def test_the_saved_default_run_replays(tmp_path):
    """The first two steps of the saved `k3course train` run, re-run here by the same loop, give its saved losses."""
    saved_file = experiments.load("tiny-default")
    saved = saved_file["result"]
    corpus = data.stdlib_corpus()
    if corpus.meta["key"] != saved["corpus"]["key"]:
        pytest.skip("this interpreter's stdlib is not the corpus the saved run read")
    model_config, train_config = train_preset("tiny")
    replay = train_config.replace(steps=2, eval_bytes=0, checkpoint_every=0)  # warmup: rates independent of steps
    with experiments.torch_threads(saved["torch_threads"]):
        train.train(train.RunConfig(model_config, replay), tmp_path / "replay", corpus=corpus, progress=False)
    losses = [r["loss"] for r in checkpoint.read_metrics(tmp_path / "replay")]
    _replayed(losses, [r["loss"] for r in saved["metrics"][:2]], saved_file.get("machine", "unknown"))


def test_a_run_stopped_early_is_the_start_of_the_full_run():
    cfg = claims.SMALL.replace(n_layers=2, n_routed_experts=4)
    settings = claims.TEXT_TRAIN.replace(steps=4, eval_bytes=256)
    full = claims.run_variant(cfg, settings, seed=1)
    start = claims.run_variant(cfg, settings, seed=1, stop_after=2)
    assert start == {"losses": full["losses"][:2], "max_violation": full["max_violation"][:2]}
    assert claims.run_variant(cfg, settings, seed=2, stop_after=2)["losses"] != start["losses"]  # the seed matters
    mqar = claims.run_variant(cfg, settings, seed=0, task="mqar")
    assert len(mqar["losses"]) == 4 and 0 <= mqar["accuracy"] <= 1


def test_recall_run_stopped_early_replays_the_first_steps_of_the_full_run():
    settings = experiments.recall_settings(steps=4, batch_size=2, warmup_steps=2).replace(lr=3e-3, seed=0)
    full = experiments.recall_run("decayed linear", settings, d_model=16, n_heads=2)
    replay = experiments.recall_run("decayed linear", settings, d_model=16, n_heads=2, stop_after=2)
    assert replay["losses"] == full["losses"][:2] and len(full["losses"]) == 4
    assert 0 <= full["accuracy"] <= 1


def test_run_variant_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="task must be 'text' or 'mqar'"):
        claims.run_variant(claims.SMALL, claims.TEXT_TRAIN, 0, task="images")
    with pytest.raises(ValueError, match="stop_after"):
        claims.run_variant(claims.SMALL, claims.TEXT_TRAIN, 0, stop_after=claims.TEXT_TRAIN.steps + 1)
    with pytest.raises(ValueError, match="make: the width does not change"):
        baselines.solve_width(lambda w: claims.SMALL, baselines.active_params, 10)


def test_spread_summarises_each_variant_over_its_seeds():
    result = {"runs": [{"variant": "a", "seed": s, "val_bpb": v} for s, v in enumerate((1.0, 2.0, 3.0))]
              + [{"variant": "b", "seed": 0, "val_bpb": 5.0}]}
    table = seed_statistics.spread(result, "val_bpb")
    assert table["a"] == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0, "n": 3}
    assert table["b"]["n"] == 1 and table["b"]["std"] == 0.0


def _two_variants(a: list[float], b: list[float], metric: str = "val_bpb") -> dict:
    return {"runs": [{"variant": label, "seed": seed, metric: value}
                     for label, values in (("a", a), ("b", b)) for seed, value in enumerate(values)]}


def test_paired_is_reproduced_when_the_95_percent_interval_of_the_mean_difference_lies_above_zero():
    # a is 0.1 lower in every seed, exactly: the interval is the point 0.1
    comparison = seed_statistics.paired(_two_variants([1.00, 1.01, 1.02], [1.10, 1.11, 1.12]), "a", "b")
    assert comparison["differences"] == pytest.approx({0: 0.1, 1: 0.1, 2: 0.1})
    assert comparison["mean"] == pytest.approx(0.1) and comparison["std"] == pytest.approx(0.0, abs=1e-12)
    assert comparison["interval"] == pytest.approx((0.1, 0.1)) and comparison["agreeing"] == 3
    assert comparison["verdict"] == "reproduced"
    # the same claim asked the other way round is reversed
    assert seed_statistics.paired(_two_variants([1.00, 1.01, 1.02], [1.10, 1.11, 1.12]), "b", "a")["verdict"] \
        == "reversed"
    # by hand: differences 0.1, 0.2, 0.3 -> mean 0.2, s = 0.1, half-width t(0.975, 2) · 0.1 / √3 = 0.2484
    spread_out = seed_statistics.paired(_two_variants([1.0, 1.0, 1.0], [1.1, 1.2, 1.3]), "a", "b")
    assert spread_out["half_width"] == pytest.approx(4.302653 * 0.1 / 3 ** 0.5, rel=1e-5)
    assert spread_out["verdict"] == "undecided"


def test_paired_reads_the_pairing_not_the_variants_own_scatter():
    one_disagrees = _two_variants([1.0, 1.0, 1.2], [1.1, 1.1, 1.1])
    assert seed_statistics.paired(one_disagrees, "a", "b")["agreeing"] == 2
    assert seed_statistics.paired(one_disagrees, "a", "b")["verdict"] == "undecided"
    # the seeds scatter by a whole unit, but b is 0.05 behind a in every seed: the pairs decide
    wide = _two_variants([1.0, 2.0, 3.0], [1.05, 2.05, 3.05])
    assert seed_statistics.paired(wide, "a", "b")["verdict"] == "reproduced"
    # every seed agrees, but the gaps vary more than their mean can carry at 2 degrees of freedom
    uneven = _two_variants([1.0, 1.0, 1.0], [1.01, 1.3, 1.02])
    assert seed_statistics.paired(uneven, "a", "b")["agreeing"] == 3
    assert seed_statistics.paired(uneven, "a", "b")["verdict"] == "undecided"


def test_paired_turns_the_sign_for_a_metric_where_higher_is_better():
    accuracies = _two_variants([0.95, 0.97, 0.96], [0.05, 0.04, 0.06], metric="accuracy")
    comparison = seed_statistics.paired(accuracies, "a", "b", "accuracy", higher_is_better=True)
    assert comparison["mean"] == pytest.approx(0.91) and comparison["verdict"] == "reproduced"
    assert seed_statistics.paired(accuracies, "a", "b", "accuracy")["verdict"] == "reversed"


def test_paired_pairs_by_seed_not_by_order_and_names_a_missing_variant():
    result = {"runs": [{"variant": "a", "seed": 2, "val_bpb": 1.0}, {"variant": "a", "seed": 0, "val_bpb": 3.0},
                       {"variant": "b", "seed": 0, "val_bpb": 3.5}, {"variant": "b", "seed": 2, "val_bpb": 1.5},
                       {"variant": "b", "seed": 7, "val_bpb": 9.0}]}
    assert seed_statistics.paired(result, "a", "b")["differences"] == {0: 0.5, 2: 0.5}
    with pytest.raises(ValueError, match="'c'"):
        seed_statistics.paired(result, "a", "c")
    with pytest.raises(ValueError, match="share no seed"):
        seed_statistics.paired({"runs": [{"variant": "a", "seed": 0, "val_bpb": 1.0},
                                     {"variant": "b", "seed": 1, "val_bpb": 1.0}]}, "a", "b")


def test_last_steps_mean_adds_each_runs_late_average_and_names_a_short_run():
    result = {"variants": {}, "runs": [{"variant": "a", "seed": 0, "max_violation": [9.0, 1.0, 2.0, 3.0]},
                                       {"variant": "b", "seed": 0, "max_violation": [0.0, 0.0, 5.0, 7.0]}]}
    late = seed_statistics.last_steps_mean(result, "max_violation", 2)
    assert [run["max_violation_last2"] for run in late["runs"]] == [2.5, 6.0]
    assert "max_violation_last2" not in result["runs"][0]  # the saved result is not changed
    assert seed_statistics.paired(late, "a", "b", "max_violation_last2")["differences"] == {0: 3.5}
    with pytest.raises(ValueError, match="fewer than 5"):
        seed_statistics.last_steps_mean(result, "max_violation", 5)


def test_cpu_seconds_sums_the_runs_trained_here_over_a_sweeps_cells_too():
    claim = {"runs": [{"seconds": 10.0}, {"seconds": 5.0}, {"seconds": 99.0, "reused_from": "other: x"}]}
    assert seed_statistics.cpu_seconds(claim) == 15.0
    sweep = {"cells": [{"runs": [{"seconds": 1.0}]}, {"runs": [{"seconds": 2.0}, {"seconds": 4.0}]}]}
    assert seed_statistics.cpu_seconds(sweep) == 7.0
    tuned = {**claim, "tuning": {"trials": {"a": [{"seconds": 3.0}, {"seconds": 8.0, "reused_from": "other: a"}]}}}
    assert seed_statistics.cpu_seconds(tuned) == 18.0  # the tuning runs trained here count too
    # a run copied from an earlier save of the same experiment was trained for it: it counts here
    again = {"runs": [{"seconds": 10.0}, {"seconds": 6.0, "reused_from": "mine: a"}, {"seconds": 9.0,
                                                                                    "reused_from": "other: b"}]}
    assert seed_statistics.cpu_seconds(again, "mine") == 16.0 and seed_statistics.cpu_seconds(again) == 10.0


def test_plot_paired_draws_one_dot_per_seed_the_interval_and_the_verdict_under_the_axes():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots()
    seed_statistics.plot_paired(axes, _two_variants([1.0, 1.01, 1.02], [1.1, 1.11, 1.12]), [("a", "b")])
    dots = [line for line in axes.lines if line.get_marker() == "."]
    assert len(dots) == 1 and list(dots[0].get_ydata()) == pytest.approx([0.1, 0.1, 0.1])
    # the verdict is a line of the pair's tick label, below the axes, not a text that can reach the title
    assert [label.get_text() for label in axes.get_xticklabels()] == ["a\nvs b\n→ reproduced"] and not axes.texts
    plt.close(figure)


# --- the variants differ in the named way ------------------------------------------------------------------

def test_the_dense_baseline_matches_tiny_k3s_active_parameters():
    variants = claims.dense_variants()
    tiny, dense = variants["tiny K3"], variants["dense Transformer"]
    assert tiny == K3Config.preset("tiny")
    assert dense.layer_types() == ("mla",) * tiny.n_layers and dense.ffn_types() == ("dense",) * tiny.n_layers
    assert dense.residual == "prenorm" and dense.ffn_activation == "swiglu" and not dense.mla_gated
    counted = accounting.param_count(dense)
    assert counted.total == counted.active  # dense: a token uses every weight
    half_ffn_width = 3 * tiny.d_model * tiny.n_layers / 2
    assert abs(counted.active - accounting.param_count(tiny).active) <= half_ffn_width
    assert abs(counted.active / accounting.param_count(tiny).active - 1) < 1e-3
    assert counted.active == sum(p.numel() for p in train.build_model(dense, 0).parameters())


def test_hybrid_variants_have_the_stated_kda_and_mla_layer_counts_and_all_mla_has_positions():
    variants = claims.hybrid_variants()
    counts = {label: (cfg.n_kda_layers, cfg.n_mla_layers) for label, cfg in variants.items()}
    assert counts == {"0:1 (all-MLA)": (0, 8), "1:1": (4, 4), "3:1": (6, 2), "7:1": (7, 1), "all-KDA": (8, 0),
                      "0:1 (all-MLA, NoPE)": (0, 8)}
    assert variants["3:1"].layer_types() == ("kda", "kda", "kda", "mla") * 2
    # all-MLA has no KDA layer to carry position: RoPE; the hybrids keep K3's NoPE MLA; NoPE all-MLA is the ablation
    assert {label: cfg.mla_rope for label, cfg in variants.items()} == {
        "0:1 (all-MLA)": True, "1:1": False, "3:1": False, "7:1": False, "all-KDA": False, "0:1 (all-MLA, NoPE)": False}
    assert variants["0:1 (all-MLA)"].replace(mla_rope=False) == variants["0:1 (all-MLA, NoPE)"]
    _same_except(variants, {"kda_per_mla", "mla_layers", "mla_rope"})
    model = train.build_model(variants["1:1"], 0)
    assert [layer.mixer_kind for layer in model.layers] == ["kda", "mla"] * 4


def test_residual_variants_differ_only_in_the_residual_in_a_deeper_narrower_model():
    tiny, variants = K3Config.preset("tiny"), claims.residual_variants()
    deep = variants["Block AttnRes"]
    assert deep.n_layers > tiny.n_layers and deep.d_model < tiny.d_model
    assert [cfg.residual for cfg in variants.values()] == ["prenorm", "block_attnres", "block_attnres"]
    assert deep.attnres_block_size == 4 and 2 * deep.n_layers // deep.attnres_block_size == 4  # 4 blocks
    assert variants["Full AttnRes"].attnres_block_size == 1  # a block per sub-layer: attention over all of them
    assert deep == claims.hybrid_variants()["3:1"]  # so residuals reuses hybrid-ratio's 3:1 runs
    _same_except(variants, {"residual", "attnres_block_size"})


def test_balancing_variants_differ_only_in_the_balancing_rule():
    variants = claims.balancing_variants()
    assert [cfg.balancing for cfg in variants.values()] == ["quantile", "sign", "aux_loss"]
    _same_except(variants, {"balancing"})
    rules = [train.build_model(cfg, 0).moe_layers()[0].balancer.balancing for cfg in variants.values()]
    assert rules == ["quantile", "sign", "aux_loss"]


def test_latent_variants_as_published_scale_n_and_k_by_d_over_l_at_equal_flops_and_bytes():
    variants = claims.latent_variants()
    full, published, wider = variants.values()
    assert list(variants) == ["full width", "latent (16 experts, top-4)", "latent, wider experts"]
    scale = full.d_model // published.latent_dim
    assert published.latent_dim == wider.latent_dim == full.d_model // 2 and full.latent_dim is None
    assert (published.n_routed_experts, published.top_k) == (full.n_routed_experts * scale, full.top_k * scale)
    assert (wider.n_routed_experts, wider.top_k) == (full.n_routed_experts, full.top_k)
    for latent in (published, wider):
        assert abs(claims.moe_flops(latent) / claims.moe_flops(full) - 1) < 0.05
    d, f = full.d_model, full.expert_dim  # router + routed top-k + shared, 2 FLOPs per multiply-add
    assert claims.moe_flops(full) == 2 * (d * full.n_routed_experts + (full.top_k + full.n_shared_experts) * 3 * d * f)
    assert claims.all_to_all_bytes(full) == 2 * full.top_k * full.d_model * 2  # dispatch + combine, bf16
    assert claims.all_to_all_bytes(published) == claims.all_to_all_bytes(full)  # k·d/ℓ vectors of ℓ: the same bytes
    assert claims.all_to_all_bytes(wider) == claims.all_to_all_bytes(full) // 2
    assert wider.expert_dim > full.expert_dim > published.expert_dim  # where each spends the d/ℓ saving
    _same_except(variants, {"latent_dim", "expert_dim", "n_routed_experts", "top_k"})


TUNED = [name for name in CLAIM_EXPERIMENTS if "lr_grid" in experiments.EXPERIMENTS[name][1]]


def test_every_tuned_result_records_per_variant_the_grid_the_rule_the_rate_the_gate_scale_and_starting_decays():
    assert {"hybrid-ratio-default", "latent-moe-default", "hybrid-ratio", "latent-moe"} <= set(TUNED)
    for name in TUNED:
        result, settings = experiments.load(name)["result"], experiments.EXPERIMENTS[name][1]
        tuned = result["tuning"]
        assert tuned["grid"] == list(settings["lr_grid"])
        # a result saved before the rule ran past an edge says so (lesson 12 lists those with an edge winner)
        assert tuned["rule"] in (tuning.RULE, tuning.RULE_WITHOUT_EXTENSION)
        short = experiments.train_config(tuned["settings"])
        assert short == tuning.tuning_settings(experiments.train_config(settings["train"])).replace(lr=short.lr)
        variants = claims.CLAIMS[settings["claim"]]()
        for label, cfg in variants.items():
            record = result["training"][label]
            trials = {trial["lr"]: trial["losses"] for trial in tuned["trials"][label]}
            beyond = tuning.extension(tuple(settings["lr_grid"]), {lr: trials[lr] for lr in settings["lr_grid"]}) \
                if tuned["rule"] == tuning.RULE else None
            assert list(trials) == sorted([*settings["lr_grid"], *([beyond] if beyond else [])]), (name, label)
            assert tuned.get("extended", {}).get(label) == beyond
            assert all(len(losses) == short.steps for losses in trials.values())
            assert record["lr"] == tuned["chosen"][label] == tuning.choose_lr(trials), (name, label)
            assert record["lr_grid"] == list(settings["lr_grid"]) and record["gate_lr_scale"] == 1.0
            assert experiments.train_config(record["train"]) == \
                experiments.train_config(settings["train"]).replace(lr=record["lr"])
            assert record["starting_decays"] == experiments.starting_decays(cfg)
            assert all(run_lr == record["lr"] for run_lr in [record["train"]["lr"]])


def test_expert_count_variants_fix_the_active_parameters_and_lower_the_activation_ratio():
    variants = claims.expert_count_variants()
    ratios = [accounting.activation_ratio(cfg) for cfg in variants.values()]
    assert ratios == [2 / n for n in claims.EXPERT_COUNTS] and ratios[0] == 0.25
    assert ratios[-1] == pytest.approx(16 / 896, abs=1e-3)  # K3's activation ratio
    counts = [accounting.param_count(cfg) for cfg in variants.values()]
    without_router = {count.active - count.components["router"][1] for count in counts}
    assert len(without_router) == 1  # only the router (n·d per MoE layer) grows with n
    totals = [accounting.param_count(cfg).total for cfg in variants.values()]
    assert totals == sorted(totals) and totals[-1] > 4 * totals[0]
    _same_except(variants, {"n_routed_experts"})


def test_equal_time_steps_scale_the_steps_by_the_step_times():
    assert experiments.equal_time_steps({"slow": 0.3, "fast": 0.1}, "slow", "fast", 100) == 300
    assert experiments.equal_time_label("dense Transformer") == "dense Transformer (equal time)"


def test_step_seconds_times_each_variant_taking_turns():
    tiny = claims.dense_variants()
    timing = experiments.step_seconds(tiny, claims.TEXT_TRAIN, rounds=1, repeats=1)
    assert set(timing) == set(tiny) and all(0 < seconds < 60 for seconds in timing.values())


def test_a_saved_equal_time_run_has_the_steps_its_step_times_give():
    """dense-baseline-default: the dense model trained again for as many steps as fit in the tiny K3's 800 (the
    step times measured in the run), more than 800 since its step is faster."""
    saved = experiments.load("dense-baseline-default")
    result, (slower, faster) = saved["result"], saved["settings"]["equal_time"]
    want = experiments.equal_time_steps(result["step_seconds"], slower, faster, saved["settings"]["train"]["steps"])
    equal = [run for run in result["runs"] if run["variant"] == experiments.equal_time_label(faster)]
    assert len(equal) == len(saved["settings"]["seeds"]) and {run["steps"] for run in equal} == {want}
    assert want > saved["settings"]["train"]["steps"]


def test_more_seeds_train_only_the_named_variants_and_are_checked(monkeypatch):
    """A pair within reach of a verdict trains two more seeds; its claim's other variants keep theirs."""
    budget = dataclasses.asdict(train.TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=1, eval_every=0,
                                                  eval_bytes=256, checkpoint_every=0))
    trained = []
    monkeypatch.setattr(experiments, "_train_variant", lambda *job: trained.append((job[0], job[3])) or {
        "losses": [1.0], "max_violation": [0.0], "val_bpb": 1.0, "seconds": 0.0})
    experiments.claim_variants("balancing", (0,), "text", budget, more_seeds={"variants": ["quantile"], "seeds": [3]})
    assert trained == [("quantile", 0), ("quantile", 3), ("sign rule", 0), ("aux loss", 0)]
    for wrong in ({"variants": ["nope"], "seeds": [3]}, {"variants": ["quantile"], "seeds": [0]}, {"seeds": [3]}):
        with pytest.raises(ValueError, match="more_seeds"):
            experiments.claim_variants("balancing", (0,), "text", budget, more_seeds=wrong)
