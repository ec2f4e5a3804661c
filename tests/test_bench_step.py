"""bench step: one training step's clock cut into rows that add up to it, checked on a toy model whose parts cost
known times, then on a K3 preset and its dense baseline."""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from k3course.bench import profile_calls
from k3course.bench.step import OTHER, STEP, attribute, breakdown, main, named_parts
from k3course.config import K3Config


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in the forward and ``backward_s`` in the backward: a part of known cost."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _Part(nn.Module):
    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.costs = forward_s, backward_s

    def forward(self, x):
        return _Sleep.apply(x, *self.costs)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.a, self.b = _Part(0.03, 0.02), _Part(0.01, 0.04)

    def forward(self, x):
        return self.b(self.a(x * self.weight)).sum()


def test_the_rows_recover_known_costs_and_add_up_to_each_step():
    toy = _Toy()

    def step():
        with torch.profiler.record_function(STEP):
            toy(torch.ones(4)).backward()
            time.sleep(0.02)  # outside every part: "other"

    with named_parts({toy.a: "A", toy.b: "B"}):
        events, _ = profile_calls(step, 2)
    steps = [event for event in events if event.name == STEP]
    per_step = attribute(events, {"A", "B"})
    assert len(per_step) == len(steps) == 2
    for rows, event in zip(per_step, steps):
        assert set(rows) == {"A", "B", OTHER} and min(rows.values()) >= 0
        assert math.isclose(sum(rows.values()), event.time_range.elapsed_us() / 1e6, rel_tol=1e-9)
        assert 0.05 <= rows["A"] < 0.065 and 0.05 <= rows["B"] < 0.065  # 30 + 20 ms and 10 + 40 ms of sleep
        assert 0.02 <= rows[OTHER] < 0.035


def test_a_part_without_a_range_is_other_not_lost():
    toy = _Toy()

    def step():
        with torch.profiler.record_function(STEP):
            toy(torch.ones(4)).backward()

    with named_parts({toy.a: "A"}):
        events, _ = profile_calls(step, 1)
    (rows,) = attribute(events, {"A"})
    assert 0.05 <= rows["A"] < 0.065 and rows[OTHER] >= 0.05  # b's 50 ms of sleep is other's


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
