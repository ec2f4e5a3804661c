"""The Triton rungs of Block AttnRes's depth read (lesson 10) and quantile balancing's histogram (lesson 03)
against their torch ops, and the model's one kernel backend choosing them.

On a CPU the kernels run under the Triton interpreter (fp32, small and odd shapes); natively on a GPU alike.
The depth read: forward and backward within 1e-5 relative to the largest entry of the torch op's; the histogram:
equal counts.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3course.config import K3Config  # noqa: E402
from k3course.kernels import TRITON_MODE  # noqa: E402
from k3course.kernels.depth_attention import depth_attention_forward, depth_attention_triton  # noqa: E402
from k3course.kernels.quantile_histogram import margin_histogram_triton  # noqa: E402
from k3course.layers.residual import BlockAttnRes, depth_attention  # noqa: E402
from k3course.model import K3Model  # noqa: E402
from k3course.moe.balancing import (  # noqa: E402
    _pooled_edges,
    histogram_quantile_bias,
    margin_histogram,
    on_this_process,
    quantile_margins,
)

DEVICE = torch.device("cuda" if TRITON_MODE == "native" else "cpu")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def depth_inputs(N, B, T, D, seed, spread=2.0):
    gen = torch.Generator().manual_seed(seed)
    sources = spread * torch.randn(N, B, T, D, generator=gen)
    return torch.randn(D, generator=gen).to(DEVICE), sources.to(DEVICE), torch.randn(B, T, D, generator=gen).to(DEVICE)


def both_ways(query, sources, grad_h, eps=1e-6):
    """(h, weights, ∂query, ∂sources) of the Triton op and of the torch op on the same inputs."""
    results = []
    for op in (depth_attention_triton, depth_attention):
        q, v = query.clone().requires_grad_(), sources.clone().requires_grad_()
        h, weights = op(q, v, eps)
        (h * grad_h).sum().backward()
        results.append((h, weights, q.grad, v.grad))
    return results


@pytest.mark.parametrize("shape", [(1, 1, 1, 7), (3, 2, 5, 20), (5, 1, 37, 64), (9, 1, 3, 300)],
                         ids=["one source", "odd D", "partial token block", "D past one warp, K3's nine sources"])
def test_depth_read_kernel_equals_torch_forward_and_backward(shape):
    query, sources, grad_h = depth_inputs(*shape, seed=sum(shape))
    triton_side, torch_side = both_ways(query, sources, grad_h)
    for name, got, want in zip(("h", "weights", "∂query", "∂sources"), triton_side, torch_side):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert relative_error(got, want) < 1e-5, (name, relative_error(got, want))


def test_depth_read_kernel_takes_strided_sources_large_logits_and_eps():
    gen = torch.Generator().manual_seed(3)
    sources = torch.randn(6, 3, 4, 2, generator=gen).permute(3, 2, 1, 0).to(DEVICE)  # [2, 4, 3, 6], not contiguous
    query = 300 * torch.randn(6, generator=gen).to(DEVICE)  # logits in the hundreds: the max must come out
    grad_h = torch.randn(4, 3, 6, generator=gen).to(DEVICE)
    assert not sources.is_contiguous()
    triton_side, torch_side = both_ways(query, sources, grad_h, eps=0.5)
    for got, want in zip(triton_side, torch_side):
        assert torch.isfinite(got).all() and relative_error(got, want) < 1e-5


def test_depth_read_kernel_with_no_tokens_and_bad_inputs():
    query, sources, _ = depth_inputs(3, 2, 0, 8, seed=4)
    h, weights = depth_attention_forward(query, sources)
    assert h.shape == (2, 0, 8) and weights.shape == (3, 2, 0)
    with pytest.raises(ValueError, match=r"query must be \[D=8\]"):
        depth_attention_forward(query[:5], sources)
    with pytest.raises(ValueError, match="sources must be"):
        depth_attention_forward(query, sources[0])
    with pytest.raises(TypeError, match="float64"):
        depth_attention_forward(query.double(), sources.double())
    with pytest.raises(ValueError, match="eps must be > 0"):
        depth_attention_forward(query, sources, eps=0.0)


def test_block_attnres_reads_through_the_kernel_with_the_triton_backend():
    """A stream built with kernels="triton" reads through the kernel (the learned key-norm weight folded into
    the query) and gives the torch stream's outputs and parameter gradients."""
    gen = torch.Generator().manual_seed(5)
    embedding, outputs = torch.randn(2, 3, 12, generator=gen), torch.randn(5, 2, 3, 12, generator=gen)
    grads = []
    for kernels in ("triton", "torch"):
        scheme = BlockAttnRes(5, 12, block_size=2, key_weight=True, kernels=kernels).to(DEVICE)
        with torch.no_grad():
            scheme.queries.copy_(torch.randn(6, 12, generator=torch.Generator().manual_seed(6)))
            scheme.key_norms.copy_(1 + 0.3 * torch.randn(6, 12, generator=torch.Generator().manual_seed(7)))
        stream, loss = scheme.begin(embedding.to(DEVICE)), 0
        for output in outputs.to(DEVICE):
            loss = loss + stream.read().square().sum()
            stream.write(output)
        (loss + stream.final().sum()).backward()
        grads.append((scheme.queries.grad, scheme.key_norms.grad))
    for got, want in zip(*grads):
        assert relative_error(got, want) < 1e-5


def test_the_model_backend_chooses_the_depth_read_kernel(monkeypatch):
    import k3course.kernels.depth_attention as module

    calls = []
    monkeypatch.setattr(module, "depth_attention_triton", lambda *args: calls.append(1) or depth_attention(*args))
    cfg = K3Config.preset("tiny").replace(residual="block_attnres", attnres_block_size=2)
    tokens = torch.zeros(1, 3, dtype=torch.long)
    K3Model.from_config(cfg, kernels="torch")(tokens)
    assert not calls
    model = K3Model.from_config(cfg, kernels="triton")
    assert model.residual.kernels == "triton"
    model.residual.begin(torch.zeros(1, 3, cfg.d_model)).read()
    assert calls == [1]


def histogram_inputs(m, n, bins, seed):
    scores = torch.rand(m, n, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    margins = quantile_margins(scores, torch.zeros(n, device=DEVICE), 1)
    return margins, _pooled_edges(margins, bins, on_this_process)


@pytest.mark.parametrize("m, n, bins", [(37, 5, 16), (2, 2, 1), (100, 70, 256)],
                         ids=["partial blocks", "one bin", "K3's 256 bins, experts past one block"])
def test_histogram_kernel_equals_torch(m, n, bins):
    margins, edges = histogram_inputs(m, n, bins, seed=m + n)
    counts = margin_histogram_triton(margins, edges)
    assert counts.dtype == torch.int64 and counts.shape == (n, bins)
    assert torch.equal(counts, margin_histogram(margins, edges))
    assert int(counts.sum()) == m * n


def test_histogram_kernel_edges_ties_strides_and_no_tokens():
    margins = torch.tensor([[0.0, 0.5, 1.0], [0.25, 0.75, -1.0], [1.0, 2.0, 0.5]], dtype=torch.float64)
    edges = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)  # margins on edges, below and above
    for view in (margins, margins.T.contiguous().T, margins.float()):
        assert torch.equal(margin_histogram_triton(view.to(DEVICE), edges.to(DEVICE)),
                           margin_histogram(margins.to(DEVICE), edges.to(DEVICE)))
    uneven = torch.tensor([-1.0, 0.1, 0.3, 2.0], dtype=torch.float64, device=DEVICE)  # not evenly spaced
    margins = margins.to(DEVICE)
    assert torch.equal(margin_histogram_triton(margins, uneven), margin_histogram(margins, uneven))
    empty = margin_histogram_triton(torch.zeros(0, 4, dtype=torch.float64, device=DEVICE), edges.to(DEVICE))
    assert empty.shape == (4, 4) and not empty.any()
    with pytest.raises(ValueError, match="edges must be"):
        margin_histogram_triton(margins, edges[:1].to(DEVICE))
    with pytest.raises(ValueError, match="margins must be"):
        margin_histogram_triton(margins.half(), edges.to(DEVICE))


def test_quantile_step_reads_the_kernels_histogram_with_the_triton_backend():
    scores = torch.rand(50, 6, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    bias = torch.zeros(6, device=DEVICE)
    assert torch.equal(histogram_quantile_bias(scores, bias, 2, 32, kernels="triton"),
                       histogram_quantile_bias(scores, bias, 2, 32, kernels="torch"))
