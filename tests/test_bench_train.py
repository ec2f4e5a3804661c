"""bench train: the real training step of K3 and of its dense baseline, timed in one run, and its ratios."""

from __future__ import annotations

import pytest

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
