"""bench step: every component of a K3 training step is timed and the table adds up to the step."""

from __future__ import annotations

import math

from k3course.bench.step import breakdown, main
from k3course.config import K3Config


def test_breakdown_names_every_component_and_adds_up_to_the_step():
    cfg = K3Config.preset("tiny")
    step, parts = breakdown(cfg, batch=1, seq=16, repeats=1)
    moe_stages = ["route", "down projection", "dispatch", "experts", "combine", "shared", "outside the ranges"]
    if cfg.latent_dim is None:
        moe_stages.remove("down projection")
    if not cfg.n_shared_experts:
        moe_stages.remove("shared")
    assert step > 0 and list(parts) == ["embedding", "KDA mixers", "MLA mixers", "dense FFN",
                                        *(f"MoE {stage}" for stage in moe_stages), "AttnRes + RMSNorms",
                                        "LM head + loss", "optimizer", "other"]
    assert all(math.isfinite(seconds) for seconds in parts.values())
    derived = ("other", "MoE outside the ranges")  # differences of two timings
    assert all(seconds > 0 for name, seconds in parts.items() if name not in derived)
    assert math.isclose(sum(parts.values()), step, rel_tol=1e-9)


def test_cli_prints_the_table_and_saves_the_plot(tmp_path, capsys):
    assert main(["--presets", "tiny", "--batch", "1", "--seq", "8", "--repeats", "1", "--return-freed-memory",
                 "--plot", str(tmp_path / "step.png")]) == 0  # in-process: leave pytest's allocator alone
    out = capsys.readouterr().out
    assert "tokens/s" in out and "KDA mixers" in out and (tmp_path / "step.png").stat().st_size > 0
