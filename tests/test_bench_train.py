"""bench train: the real training step of K3 and of its dense baseline, timed in one run, and its ratios."""

from __future__ import annotations

import pytest
import torch

from k3course.baselines import active_params, dense_transformer
from k3course.bench import train as bench_train
from k3course.config import K3Config
from k3course.train import TrainConfig


def test_variants_are_the_preset_and_its_dense_baseline_of_equal_active_parameters():
    tiny = K3Config.preset("tiny")
    models = bench_train.variants(tiny)
    assert list(models) == ["tiny", "dense (tiny)"] and models["dense (tiny)"] == dense_transformer(tiny)
    assert active_params(models["dense (tiny)"]) == pytest.approx(active_params(tiny), rel=0.02)


def test_measure_reports_steps_tokens_and_the_ratio_of_the_two_models():
    train = TrainConfig(batch_size=2, seq_len=32, grad_accum=2)
    results = bench_train.measure(["tiny"], train, ["eager"], repeats=1, rounds=1)
    rows = {(row["model"], row["mode"]): row for row in results["rows"]}
    assert set(rows) == {("tiny", "eager"), ("dense (tiny)", "eager")}
    for row in rows.values():
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(2 * 2 * 32 / row["step_s"])
    ratio = results["ratios"]["tiny"]["K3 / dense, eager"]
    assert ratio == pytest.approx(rows[("tiny", "eager")]["step_s"] / rows[("dense (tiny)", "eager")]["step_s"])
    assert "K3 / dense, eager" in bench_train.report(results)


@pytest.mark.parametrize("options, message", [(["--batch", "0"], "--batch"), (["--grad-accum", "0"], "--grad-accum"),
                                              (["--modes", "jit"], "--modes")])
def test_bad_options_are_named(options, message, capsys):
    with pytest.raises(SystemExit):
        bench_train.main(options)
    assert message in capsys.readouterr().err


def test_a_saved_result_round_trips_and_is_drawn(tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = tmp_path / "train_bench.json"
    options = ["--modes", "eager", "--batch", "2", "--seq", "16", "--repeats", "1", "--rounds", "1", "--out", str(out)]
    assert bench_train.main(options) == 0
    printed = capsys.readouterr().out
    fig, axes = plt.subplots()
    saved = bench_train.show_results(out, axes)
    shown = capsys.readouterr().out
    assert saved["command"] == "k3course bench train " + " ".join(options) and "K3 / dense, eager" in shown
    assert bench_train.report(saved) in printed and len(axes.patches) == 2  # one bar per model
    plt.close(fig)


def test_the_sweep_keeps_the_bytes_per_step_and_reports_k3_over_dense_at_each_length():
    results = bench_train.measure_sweep("tiny", 64, [16, 32], ["eager"], repeats=1, rounds=1)
    assert [(p["seq_len"], p["batch_size"], p["mode"]) for p in results["points"]] == [(16, 4, "eager"),
                                                                                        (32, 2, "eager")]
    for point in results["points"]:
        assert point["k3_step_s"] > 0 and point["dense_step_s"] > 0
        assert point["ratio"] == pytest.approx(point["k3_step_s"] / point["dense_step_s"])
    assert results["bytes_per_step"] == 64 and "K3 / dense" in bench_train.sweep_report(results)


@pytest.mark.parametrize("options", [["--sweep", "--bytes", "100", "--seqs", "64"],
                                     ["--sweep", "--presets", "tiny", "small"], ["--sweep", "--bytes", "0"]])
def test_bad_sweep_options_are_named(options, capsys):
    with pytest.raises(SystemExit):
        bench_train.main(options)
    assert "--bytes" in capsys.readouterr().err


def test_a_saved_sweep_round_trips_and_is_drawn(tmp_path, capsys, same_threads):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = tmp_path / "train_sweep.json"
    options = ["--sweep", "--modes", "eager", "--bytes", "32", "--seqs", "16", "32", "--repeats", "1", "--rounds", "1",
               "--threads", "1", "--out", str(out)]
    assert bench_train.main(options) == 0
    printed = capsys.readouterr().out
    fig, axes = plt.subplots()
    saved = bench_train.show_sweep(out, axes)
    shown = capsys.readouterr().out
    assert saved["command"] == "k3course bench train " + " ".join(options) and saved["threads"] == 1
    assert saved["torch"] == torch.__version__ and saved["machine"] and saved["device"] == "cpu"
    assert bench_train.sweep_report(saved) in printed and bench_train.sweep_report(saved) in shown
    assert [line.get_xdata().tolist() for line in axes.lines] == [[16, 32], [16, 32]]  # K3 and dense
    assert len(axes.texts) == 2  # K3 / dense at each T
    plt.close(fig)


def test_the_sweep_runs_eager_unless_asked_and_covers_128_to_4096_bytes_at_4096_per_step():
    sweep, one_length = bench_train._options(["--sweep"]), bench_train._options([])
    assert sweep.modes == ["eager"] and one_length.modes == ["eager", "compiled"]
    assert (sweep.bytes, sweep.seqs) == (4096, [128, 256, 512, 1024, 2048, 4096])
    assert bench_train._options(["--sweep", "--modes", "eager", "compiled"]).modes == ["eager", "compiled"]
