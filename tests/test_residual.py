"""Residual schemes: NumPy and torch agree; Block(1) = Full; one block = embedding + running sum; zero queries
start uniform."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3course.config import RESIDUALS
from k3course.layers.residual import (
    RESIDUAL_KINDS,
    BlockAttnRes,
    FullAttnRes,
    StandardResidual,
    depth_attention,
    depth_weight_matrix,
    make_residual,
)
from k3course.reference import attnres as ref

B, T, D, L = 2, 5, 8, 6


def sublayers(seed: int = 0) -> list[torch.nn.Module]:
    """Small nonlinear sub-layers with fp64 weights (a stand-in for attention / MLP)."""
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()).double() for _ in range(L)]


def embedding(seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def run(scheme, layers, x, record=False):
    """The loop a decoder stack runs: read, sub-layer, write; then final. Returns (final, inputs, stream)."""
    stream = scheme.begin(x, record=record)
    inputs = []
    for layer in layers:
        h = stream.read()
        inputs.append(h)
        stream.write(layer(h))
    return stream.final(), inputs, stream


def random_queries(scheme, seed=2):
    with torch.no_grad():
        scheme.queries.copy_(torch.randn(scheme.queries.shape, generator=torch.Generator().manual_seed(seed)))
    return scheme.double()


def numpy_sublayers(layers):
    return [lambda h, layer=layer: layer(torch.from_numpy(h)[None]).detach()[0].numpy() for layer in layers]


@pytest.mark.parametrize("block_size", [None, 1, 2, 4, 6])
def test_torch_matches_numpy_reference(block_size):
    layers, x = sublayers(), embedding()
    scheme = FullAttnRes(L, D) if block_size is None else BlockAttnRes(L, D, block_size)
    random_queries(scheme)
    final, inputs, _ = run(scheme, layers, x)
    queries = scheme.queries.detach().numpy()
    for b in range(B):
        final_ref, inputs_ref = ref.run_stack(x[b].numpy(), numpy_sublayers(layers), queries, block_size)
        np.testing.assert_allclose(final[b].detach().numpy(), final_ref, rtol=1e-10, atol=1e-12)
        for got, want in zip(inputs, inputs_ref):
            np.testing.assert_allclose(got[b].detach().numpy(), want, rtol=1e-10, atol=1e-12)


def test_standard_matches_numpy_reference():
    layers, x = sublayers(), embedding()
    final, inputs, _ = run(StandardResidual(L, D), layers, x)
    final_ref, _ = ref.run_stack(x[0].numpy(), numpy_sublayers(layers))
    np.testing.assert_allclose(final[0].detach().numpy(), final_ref, rtol=1e-12)
    torch.testing.assert_close(inputs[1], x + layers[0](x))


def test_block_size_one_equals_full():
    layers, x = sublayers(), embedding()
    full, block = random_queries(FullAttnRes(L, D)), random_queries(BlockAttnRes(L, D, block_size=1))
    final_full, inputs_full, stream_full = run(full, layers, x, record=True)
    final_block, inputs_block, stream_block = run(block, layers, x, record=True)
    torch.testing.assert_close(final_block, final_full, rtol=1e-12, atol=1e-12)
    for got, want in zip(inputs_block, inputs_full):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip(stream_block.weights, stream_full.weights):
        torch.testing.assert_close(got, want)


def test_one_block_mixes_embedding_and_running_sum():
    """N = 1 block is a standard residual with the embedding kept apart."""
    layers, x = sublayers(), embedding()
    block = random_queries(BlockAttnRes(L, D, block_size=L))
    final, inputs, stream = run(block, layers, x, record=True)
    outputs = [layer(h) for layer, h in zip(layers, inputs)]
    for index, h in enumerate([*inputs[1:], final], start=1):
        running_sum = sum(outputs[:index])
        expected, _ = depth_attention(block.queries[index], torch.stack([x, running_sum]))
        torch.testing.assert_close(h, expected, rtol=1e-12, atol=1e-12)
        assert stream.weights[index].shape == (2, B, T)
    torch.testing.assert_close(inputs[0], x)           # the first read sees only the embedding


def test_one_block_with_zero_queries_is_standard_prenorm_up_to_scale():
    """Zero queries: h_l = (v_0 + Σ v_i) / 2, so RMSNorm(h_l) is exactly what a PreNorm sub-layer reads."""
    layers, x = sublayers(), embedding()
    norm = lambda h: torch.nn.functional.rms_norm(h, (D,), eps=1e-12)
    prenorm_layers = [lambda h, f=f: f(norm(h)) for f in layers]
    _, inputs_standard, _ = run(StandardResidual(L, D), prenorm_layers, x)
    _, inputs_block, _ = run(BlockAttnRes(L, D, block_size=L).double(), prenorm_layers, x)
    for index, (got, want) in enumerate(zip(inputs_block, inputs_standard)):
        torch.testing.assert_close(got, want / (1 if index == 0 else 2), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(norm(got), norm(want), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scheme", [FullAttnRes(L, D), BlockAttnRes(L, D, 2), BlockAttnRes(L, D, 4)],
                         ids=["full", "block2", "block4"])
def test_zero_queries_start_as_uniform_average(scheme):
    layers, x = sublayers(), embedding()
    assert torch.count_nonzero(scheme.queries) == 0
    _, inputs, stream = run(scheme.double(), layers, x, record=True)
    assert len(stream.weights) == L + 1
    for index, weights in enumerate(stream.weights):
        n = weights.shape[0]
        torch.testing.assert_close(weights, torch.full_like(weights, 1.0 / n))
        if index < L:
            sources = stream_sources_at(scheme, layers, x, index)
            torch.testing.assert_close(inputs[index], sources.mean(dim=0))


def stream_sources_at(scheme, layers, x, index):
    """Rebuild the sources of read ``index`` independently of the stream's own bookkeeping."""
    stream = scheme.begin(x)
    for layer in layers[:index]:
        stream.write(layer(stream.read()))
    if isinstance(scheme, FullAttnRes):
        return torch.stack(stream.values)
    return stream.sources()


def test_block_sources_follow_block_boundaries():
    layers, x = sublayers(), embedding()
    scheme = BlockAttnRes(L, D, block_size=4).double()
    counts = []
    stream = scheme.begin(x, record=True)
    for layer in layers:
        stream.write(layer(stream.read()))
    stream.final()
    counts = [w.shape[0] for w in stream.weights]
    # sources: emb | emb+partial(1..3) | emb+block1 | emb+block1+partial(5) | final: emb+block1+partial(5,6)
    assert counts == [1, 2, 2, 2, 2, 3, 3]


def test_weights_are_retrievable_as_a_matrix():
    layers, x = sublayers(), embedding()
    _, _, stream = run(random_queries(FullAttnRes(L, D)), layers, x, record=True)
    matrix = depth_weight_matrix(stream.weights, L)
    assert matrix.shape == (L + 1, L + 1)
    torch.testing.assert_close(torch.nansum(matrix, dim=1), torch.ones(L + 1))
    assert torch.isnan(matrix[0, 1:]).all() and not torch.isnan(matrix[L]).any()
    block_matrix = depth_weight_matrix(run(BlockAttnRes(L, D, 4).double(), layers, x, True)[2].weights, L, 4)
    assert block_matrix.shape == (L + 1, 3)


def test_gradients_reach_the_queries():
    layers, x = sublayers(), embedding()
    scheme = BlockAttnRes(L, D, 2).double()
    final, _, _ = run(scheme, layers, x)
    final.square().sum().backward()
    assert scheme.queries.grad is not None and scheme.queries.grad.abs().sum() > 0


def test_fp32_input_keeps_dtype():
    scheme = FullAttnRes(L, D)
    x = embedding().float()
    stream = scheme.begin(x)
    assert stream.read().dtype == torch.float32


def test_make_residual_takes_the_configs_names():
    assert isinstance(make_residual("prenorm", L, D), StandardResidual)
    assert isinstance(make_residual("full_attnres", L, D), FullAttnRes)
    assert make_residual("block_attnres", L, D, 3).block_size == 3
    assert set(RESIDUALS) <= set(RESIDUAL_KINDS), "every K3Config.residual is a scheme of the same name"
    with pytest.raises(ValueError, match="block_size is needed"):
        make_residual("block_attnres", L, D)
    for unknown in ("dense", "standard", "block"):
        with pytest.raises(ValueError, match=r"kind must be one of \('prenorm', 'full_attnres', 'block_attnres'\)"):
            make_residual(unknown, L, D)


# --- bad input -------------------------------------------------------------------------------------------------

def test_bad_sizes_and_inputs_are_named():
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockAttnRes(L, D, 0)
    with pytest.raises(ValueError, match="n_sublayers must be a positive int"):
        FullAttnRes(0, D)
    with pytest.raises(ValueError, match=r"embedding must be \[B, T, d_model=8\]"):
        FullAttnRes(L, D).begin(torch.zeros(T, D))
    stream = StandardResidual(L, D).begin(embedding())
    with pytest.raises(ValueError, match="output must have the embedding's shape"):
        stream.write(torch.zeros(B, T, D + 1))


def test_read_write_order_is_enforced():
    stream = FullAttnRes(1, D).double().begin(embedding())
    with pytest.raises(RuntimeError, match="final\\(\\) after 0 of 1 sub-layers"):
        stream.final()
    stream.write(stream.read())
    with pytest.raises(RuntimeError, match="all 1 sub-layers are written"):
        stream.read()
    with pytest.raises(RuntimeError, match="the stack has only 1 sub-layers"):
        stream.write(embedding())


def test_reference_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        ref.block_sources(np.zeros((T, D)), [], 0)


@pytest.mark.parametrize("block_size", [1, 2, 4, 6, 9])
def test_block_sources_function_matches_the_stream_and_reference(block_size):
    from k3course.layers.residual import block_attnres_read, block_sources

    layers, x = sublayers(), embedding()
    scheme = random_queries(BlockAttnRes(L, D, block_size))
    stream, outputs = scheme.begin(x), []
    for index, layer in enumerate(layers):
        torch.testing.assert_close(block_sources(x, outputs, block_size), stream.sources())
        want = ref.block_sources(x[0].numpy(), [o[0].detach().numpy() for o in outputs], block_size)
        np.testing.assert_allclose(block_sources(x, outputs, block_size)[:, 0].detach().numpy(), np.stack(want))
        h = stream.read()
        torch.testing.assert_close(block_attnres_read(x, outputs, scheme.queries[index], block_size), h)
        outputs.append(layer(h))
        stream.write(outputs[-1])


@pytest.mark.parametrize("block_size", [None, 1, 2, 4, 9])
def test_visible_sources_matches_what_the_stream_attends(block_size):
    from k3course.layers.residual import visible_sources

    layers, x = sublayers(), embedding()
    scheme = FullAttnRes(L, D) if block_size is None else BlockAttnRes(L, D, block_size)
    _, _, stream = run(scheme.double(), layers, x, record=True)
    grid = visible_sources(L, block_size)
    assert grid.shape == (L + 1, L + 1)
    for read, weights in enumerate(stream.weights):
        assert int(grid[read].max()) + 1 == weights.shape[0]          # one source per distinct id
        assert (grid[read, : read + 1] >= 0).all() and (grid[read, read + 1:] == -1).all()
    with pytest.raises(ValueError, match="block_size must be a positive int or None"):
        visible_sources(L, 0)


def _depth_attention_through_keys(query, sources, eps):
    """The textbook form autograd differentiates: keys RMSNorm(v_i) materialised, softmax over depth."""
    keys = torch.nn.functional.rms_norm(sources, (sources.shape[-1],), eps=eps)
    weights = torch.softmax(keys @ query, dim=0)
    return (weights.unsqueeze(-1) * sources).sum(0), weights


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_depth_attention_closed_form_backward_equals_autograd_through_the_keys(dtype):
    """Sources of very different scales (1, 30, 1e-3) and an all-zero source (its key is 0, its logit 0)."""
    gen = torch.Generator().manual_seed(3)
    scales = torch.tensor([1.0, 30.0, 1e-3, 0.0], dtype=dtype).view(4, 1, 1, 1)
    sources = (torch.randn(4, B, T, D, generator=gen, dtype=dtype) * scales).requires_grad_()
    query = torch.randn(D, generator=gen, dtype=dtype).requires_grad_()
    grad_h = torch.randn(B, T, D, generator=gen, dtype=dtype)
    h, weights = depth_attention(query, sources, eps=1e-6)
    h_ref, weights_ref = _depth_attention_through_keys(query, sources, 1e-6)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref, **tol)
    torch.testing.assert_close(weights, weights_ref, **tol)
    grads = torch.autograd.grad(h, (query, sources), grad_h)
    grads_ref = torch.autograd.grad(h_ref, (query, sources), grad_h)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"] * 30)
    assert all(torch.isfinite(g).all() for g in grads)


def test_depth_attention_gradcheck():
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(D, generator=gen, dtype=torch.float64, requires_grad=True)
    sources = torch.randn(3, 2, 3, D, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, s: depth_attention(q, s)[0], (query, sources))
    (grad_query,) = torch.autograd.grad(depth_attention(query, sources)[0].sum(), query, create_graph=True)
    with pytest.raises(RuntimeError):  # the backward is written once: no silently wrong second derivative
        torch.autograd.grad(grad_query.sum(), sources)


def test_depth_attention_keeps_bf16_sources_in_their_dtype_and_computes_in_fp32():
    gen = torch.Generator().manual_seed(5)
    sources = torch.randn(3, B, T, D, generator=gen).bfloat16().requires_grad_()
    query = torch.randn(D, generator=gen, requires_grad=True)
    h, weights = depth_attention(query, sources)
    assert h.dtype == torch.bfloat16 and weights.dtype == torch.float32
    h.float().sum().backward()
    assert sources.grad.dtype == torch.bfloat16 and query.grad.dtype == torch.float32
    h_ref, _ = _depth_attention_through_keys(query.detach(), sources.detach().float(), 1e-6)
    torch.testing.assert_close(h.float(), h_ref, rtol=1e-2, atol=1e-2)
