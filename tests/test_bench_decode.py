"""``k3course bench decode``: the cache bytes held equal the accounting, for both fills, and the command runs."""

import json

import pytest
import torch

from k3course import accounting
from k3course.bench import decode
from k3course.config import K3Config
from k3course.model import K3Model

TINY = K3Config.preset("tiny")


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {name: K3Model.from_config(cfg).eval() for name, cfg in decode.schedule_configs(TINY).items()}


def test_schedules_are_all_mla_hybrid_all_kda():
    kinds = {name: cfg.layer_types() for name, cfg in decode.schedule_configs(TINY).items()}
    assert kinds["all-MLA"] == ("mla",) * 4
    assert kinds["hybrid 3:1"] == ("kda", "kda", "kda", "mla")
    assert kinds["all-KDA"] == ("kda",) * 4


@pytest.mark.parametrize("fill", ["random", "prefill"])
@pytest.mark.parametrize("batch, context", [(1, 0), (1, 37), (3, 100)])
def test_measured_bytes_equal_accounting(models, fill, batch, context):
    with torch.no_grad():
        rows = decode.measure_point(models, batch, context, steps=1, fill=fill, chunk=16)
    for name, row in rows.items():
        expected = batch * accounting.kv_cache_bytes(decode.schedule_configs(TINY)[name], context, dtype_bytes=4)
        assert row["measured_bytes"] == row["predicted_bytes"] == expected, name
        assert row["tpot_best_s"] > 0


def test_random_fill_holds_what_a_prefill_holds(models):
    model = models["hybrid 3:1"]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        filled, prefilled = model.new_cache(2, 40), model.new_cache(2, 40)
        decode.fill_random(filled, 33, generator)
        decode.fill_prefill(model, prefilled, 33, 8, generator)
    assert filled.length == prefilled.length == 33
    assert [c.nbytes() for c in filled.layers] == [c.nbytes() for c in prefilled.layers]


def test_slope_of_a_line():
    assert decode.slope_us_per_1k([0, 1000, 2000], [1.0, 1.5, 2.0]) == pytest.approx(0.5e6)


def test_quick_run_saves_json_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(decode, "RESULTS", tmp_path)
    assert decode.main(["--quick", "--save", "--return-freed-memory"]) == 0  # leave pytest's allocator alone
    results = json.loads((tmp_path / "decode_bench.json").read_text())
    assert {p["schedule"] for p in results["points"]} == set(decode.SCHEDULES)
    assert all(p["measured_bytes"] == p["predicted_bytes"] for p in results["points"])
    assert (tmp_path / "decode_bench.png").stat().st_size > 0
    assert "TPOT slope" in capsys.readouterr().out


def test_bad_fill_names_the_argument(models):
    with pytest.raises(ValueError, match="fill"):
        decode.measure_point(models, 1, 4, 1, fill="magic")
