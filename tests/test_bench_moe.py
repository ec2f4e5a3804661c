"""bench moe's stage rows are the real layer's profiler ranges, read by ``k3course.bench.range_seconds``: a range
renamed in the layer renames its row, nested ranges are not counted twice, a stage's backward is added to it,
and the stages fit inside the profiled call. The ranges change nothing the layer computes."""

from __future__ import annotations

import pytest
import torch
from helpers import profiler_event, profiler_events

import k3course.moe.layers as moe_layers
from k3course.bench import BACKWARD_EVENT, range_seconds
from k3course.bench.moe import main, stage_seconds, training_step
from k3course.debug import profiler_range
from k3course.moe import LatentMoE

SMALL = ["--m", "64", "--n", "8", "--k", "2", "--d", "32", "--latent", "16", "--d-expert", "16", "--repeats", "1",
         "--rounds", "1", "--loop-tokens", "8", "--return-freed-memory"]  # in-process: leave pytest's allocator


def _traced_call(offset: int):
    """One profiled call (µs): range moe.outer 300 with moe.inner 200 nested inside, moe.slow backward 50; the
    backward of the node outer's op made 50, of inner's 10, of slow backward's 300."""
    return profiler_event(
        "call", offset, offset + 1000,
        profiler_event("moe.outer", offset, offset + 300,
                       profiler_event("aten::mul", offset + 10, offset + 60, sequence_nr=1),
                       profiler_event("moe.inner", offset + 100, offset + 300,
                                      profiler_event("aten::add", offset + 150, offset + 160, sequence_nr=3))),
        profiler_event("moe.slow backward", offset + 300, offset + 350,
                       profiler_event("aten::clone", offset + 310, offset + 340, sequence_nr=2)),
        profiler_event(BACKWARD_EVENT + "CloneBackward0", offset + 400, offset + 700, sequence_nr=2),
        profiler_event(BACKWARD_EVENT + "MulBackward0", offset + 700, offset + 750, sequence_nr=1),
        profiler_event(BACKWARD_EVENT + "AddBackward0", offset + 750, offset + 760, sequence_nr=3))


def test_range_seconds_reads_the_ranges_in_order_without_double_counting_and_adds_each_backward():
    """On a recorded trace of two calls: the nested range's time is its own, not outer's; the backward of the
    nodes a range's own ops made is added to it."""
    stages = range_seconds(profiler_events(_traced_call(0), _traced_call(2000)), "moe.", 2)
    expected = {"outer": 100 + 50, "inner": 200 + 10, "slow backward": 50 + 300}
    assert list(stages) == list(expected)
    assert stages == pytest.approx({stage: us / 1e6 for stage, us in expected.items()}, rel=1e-12)


def test_bench_moe_rows_are_the_layers_ranges(monkeypatch, capsys):
    layer = LatentMoE(32, 8, 2, d_expert=16, generator=torch.Generator().manual_seed(0)).eval()
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
    layer = LatentMoE(32, 8, 2, n_shared=1, d_expert=16, generator=torch.Generator().manual_seed(1)).train(training)
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
