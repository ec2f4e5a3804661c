"""bench moe's stage rows are the real layer's profiler ranges, read by ``k3course.bench.range_seconds``: a range
renamed in the layer renames its row, nested ranges are not counted twice, a stage's backward is added to it,
and the stages fit inside the profiled call. The ranges change nothing the layer computes."""

from __future__ import annotations

import time

import pytest
import torch

import k3course.moe.layers as moe_layers
from k3course.bench import profile_calls, range_seconds
from k3course.bench.moe import main, stage_seconds, training_step
from k3course.debug import profiler_range
from k3course.moe import LatentMoE

SMALL = ["--m", "64", "--n", "8", "--k", "2", "--d", "32", "--latent", "16", "--expert-dim", "16", "--repeats", "1",
         "--rounds", "1", "--loop-tokens", "8", "--return-freed-memory"]  # in-process: leave pytest's allocator


class _SlowBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps ``seconds``: a stage whose time is all in the backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Dummy(torch.nn.Module):
    """Ranges moe.outer (with moe.inner nested inside, which sleeps) and moe.slow backward (a sleeping backward)."""

    def forward(self, x):
        with profiler_range("moe.outer"):
            y = x * 2
            with profiler_range("moe.inner"):
                time.sleep(0.02)
                y = y + 1
        with profiler_range("moe.slow backward"):
            return _SlowBackward.apply(y, 0.03)


def test_range_seconds_reads_the_ranges_in_order_without_double_counting_and_adds_each_backward():
    x = torch.randn(4, 4, requires_grad=True)
    events, profiled = profile_calls(lambda: Dummy()(x).sum().backward(), 2)
    stages = range_seconds(events, "moe.", 2)
    assert list(stages) == ["outer", "inner", "slow backward"]
    assert stages["inner"] >= 0.02 and stages["outer"] < 0.01, "the nested range's time is its own, not outer's"
    assert stages["slow backward"] >= 0.03, "the backward of the nodes a range made is added to it"
    assert sum(stages.values()) <= profiled


def test_bench_moe_rows_are_the_layers_ranges(monkeypatch, capsys):
    layer = LatentMoE(32, 8, 2, expert_dim=16, generator=torch.Generator().manual_seed(0)).eval()
    x = torch.randn(64, 32)
    with torch.no_grad():
        stages, profiled, gemms = stage_seconds(lambda: layer(x), 2)
    assert list(stages) == ["route", "down projection", "dispatch", "experts", "combine"]
    assert 0 < sum(stages.values()) <= profiled and 0 < gemms <= profiled
    layer.train()
    stages, profiled, _ = stage_seconds(training_step(layer, x, torch.ones_like(x)), 2)
    assert list(stages) == ["route", "down projection", "dispatch", "experts", "combine", "bias update"]
    assert sum(stages.values()) <= profiled

    renamed = lambda name: profiler_range("moe.routing, renamed" if name == "moe.route" else name)
    monkeypatch.setattr(moe_layers, "profiler_range", renamed)
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert "  routing, renamed " in out and "  route " not in out, "a row for each range the layer opens"


@pytest.mark.parametrize("training", [False, True])
def test_the_ranges_change_nothing_the_layer_computes(training):
    layer = LatentMoE(32, 8, 2, n_shared_experts=1, expert_dim=16, generator=torch.Generator().manual_seed(1))
    layer.train(training)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    outputs = []
    for profiled in (False, True):
        layer.zero_grad(), layer.reset_statistics()
        x.grad = None
        if profiled:
            with torch.profiler.profile():
                y = layer(x)
                y.square().sum().backward()
        else:
            y = layer(x)
            y.square().sum().backward()
        outputs.append([y.detach(), x.grad.clone(), layer.experts.gate_up.grad.clone()])
    for got, want in zip(*outputs):
        assert torch.equal(got, want)
