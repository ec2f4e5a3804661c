"""bench step: one training step's clock cut into rows that add up to it, checked on a recorded trace whose parts
cost known times (no test here bounds a wall-clock time: the machine may be busy), on a real profile of a toy model,
then on a K3 preset and its dense baseline."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import profiler_event, profiler_events
from torch import nn

from k3course.bench import BACKWARD_EVENT, profile_calls
from k3course.bench.step import OTHER, STEP, attribute, breakdown, main, named_parts
from k3course.config import K3Config


def _traced_step(offset: int):
    """One profiled step of known costs (µs): part A's forward 300 (its op made autograd node 1), part B's 100 (node
    2, with the MoE stage range "moe.route" of 30 inside), the backward of node 2 300 and of node 1 100, a node
    without a forward (an AccumulateGrad) 50, and the step's own time between them 150: 1000 in all."""
    return profiler_event(
        STEP, offset, offset + 1000,
        profiler_event("A", offset + 100, offset + 400,
                       profiler_event("aten::clone", offset + 150, offset + 350, sequence_nr=1)),
        profiler_event("B", offset + 400, offset + 500,
                       profiler_event("aten::mul", offset + 410, offset + 420, sequence_nr=2),
                       profiler_event("moe.route", offset + 430, offset + 460)),
        profiler_event(BACKWARD_EVENT + "MulBackward0", offset + 500, offset + 800,
                       profiler_event("aten::mul", offset + 550, offset + 650), sequence_nr=2),
        profiler_event(BACKWARD_EVENT + "CloneBackward0", offset + 800, offset + 900, sequence_nr=1),
        profiler_event(BACKWARD_EVENT + "AccumulateGrad", offset + 900, offset + 950, sequence_nr=7))


def test_the_rows_recover_known_costs_and_add_up_to_each_step():
    """On a recorded trace of two steps: each range's exclusive time and the backward of the nodes its ops made
    go to its row, a MoE stage range to its own row, the rest to "other"."""
    per_step = attribute(profiler_events(_traced_step(5000), _traced_step(0)), {"A", "B"})
    expected = {"A": 300 + 100, "B": 70 + 300, "MoE route": 30, OTHER: 150 + 50}
    assert per_step == [pytest.approx({row: us / 1e6 for row, us in expected.items()}, rel=1e-12)] * 2


def test_a_part_without_a_range_is_other_not_lost():
    (rows,) = attribute(profiler_events(_traced_step(0)), {"A"})
    expected = {"A": 300 + 100, "MoE route": 30, OTHER: 70 + 300 + 150 + 50}  # B's forward and backward are other's
    assert rows == pytest.approx({row: us / 1e6 for row, us in expected.items()}, rel=1e-12)


class _Part(nn.Module):
    def forward(self, x):
        return x * 2


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.a, self.b = _Part(), _Part()

    def forward(self, x):
        return self.b(self.a(x * self.weight)).sum()


def test_a_real_profile_gives_each_step_rows_that_add_up_to_it():
    """The same reading on what ``torch.profiler`` records: every step cut into the parts' rows and "other", which
    add up to its span (no bound on any time: the machine may be busy)."""
    toy = _Toy()

    def step():
        with torch.profiler.record_function(STEP):
            toy(torch.ones(4)).backward()

    with named_parts({toy.a: "A", toy.b: "B"}):
        events, _ = profile_calls(step, 2)
    steps = [event for event in events if event.name == STEP]
    per_step = attribute(events, {"A", "B"})
    assert len(per_step) == len(steps) == 2
    for rows, event in zip(per_step, steps):
        assert set(rows) == {"A", "B", OTHER} and min(rows.values()) >= 0
        assert math.isclose(sum(rows.values()), event.time_range.elapsed_us() / 1e6, rel_tol=1e-9)


def test_breakdown_of_k3_names_its_parts_and_adds_up():
    result = breakdown({"tiny": K3Config.preset("tiny")}, batch=1, seq=16, repeats=1)["tiny"]
    rows = result["rows"]
    assert {"KDA mixers", "MLA mixers", "dense FFN", "MoE experts", "MoE route", "RMSNorms", "optimizer",
            "residual reads + writes", "MoE bias update", OTHER} <= set(rows)
    assert min(rows.values()) >= 0 and math.isclose(sum(rows.values()), result["profiled"], rel_tol=1e-9)
    assert result["step"] > 0


def test_cli_prints_both_models_and_saves_the_plot(tmp_path, capsys):
    assert main(["--presets", "tiny", "--batch", "1", "--seq", "8", "--repeats", "1", "--rounds", "1",
                 "--return-freed-memory",
                 "--plot", str(tmp_path / "step.png")]) == 0  # in-process: leave pytest's allocator alone
    out = capsys.readouterr().out
    assert "tokens/s" in out and "KDA mixers" in out and "dense (tiny)" in out and "sum of the rows" in out
    assert "per training step (unprofiled" in out and (tmp_path / "step.png").stat().st_size > 0
