"""bench step: every component of a K3 training step is timed and the table adds up to the step."""

from __future__ import annotations

import math

from k3course.bench.step import breakdown, main
from k3course.config import K3Config


def test_breakdown_names_every_component_and_adds_up_to_the_step():
    step, parts = breakdown(K3Config.preset("tiny"), batch=1, seq=16, repeats=1)
    assert step > 0 and set(parts) == {"embedding", "KDA mixers", "MLA mixers", "dense FFN", "MoE routing",
                                       "MoE experts", "MoE dispatch + combine + shared", "AttnRes + RMSNorms",
                                       "LM head + loss", "optimizer", "other"}
    assert all(math.isfinite(seconds) for seconds in parts.values())
    derived = ("other", "MoE dispatch + combine + shared")  # differences of two timings
    assert all(seconds > 0 for name, seconds in parts.items() if name not in derived)
    assert math.isclose(sum(parts.values()), step, rel_tol=1e-9)


def test_cli_prints_the_table_and_saves_the_plot(tmp_path, capsys):
    assert main(["--presets", "tiny", "--batch", "1", "--seq", "8", "--repeats", "1",
                 "--plot", str(tmp_path / "step.png")]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "KDA mixers" in out and (tmp_path / "step.png").stat().st_size > 0
