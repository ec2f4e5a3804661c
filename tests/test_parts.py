"""The learner's parts inside the real model: use_parts swaps them in (and restores them), compare finds the
first sub-layer where a wrong part departs."""

from __future__ import annotations

import pytest
import torch

from k3course import parts as registry
from k3course.config import K3Config
from k3course.layers import kda as kda_layer
from k3course.layers import mla
from k3course.layers.residual import depth_attention
from k3course.lessons.parts import PART_NAMES, compare, use_parts
from k3course.model import K3Model
from k3course.moe import dispatch, experts, latent, routing
from k3course.ops import chunk, recurrent

KDA_STEP, UT_TRANSFORM = recurrent.kda_step, chunk.ut_transform  # the package's, before any swap


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3Model.from_config(K3Config.preset("tiny")).eval()


def tokens(length: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(length))


def counting(fn, calls: dict, name: str):
    def wrapped(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapped


def test_every_part_is_called_by_the_model_and_restored_after(model):
    calls = {}
    originals = {"topk_route": routing.topk_route, "router_scores": routing.router_scores,
                 "ut_transform": chunk.ut_transform, "kda_step": recurrent.kda_step,
                 "depth_attention": depth_attention, "shared_experts": experts.glu_ffn, "situ_glu": experts.situ_glu,
                 "latent_combine": latent.latent_combine, "short_conv": kda_layer.short_conv,
                 "kda_gate": kda_layer.kda_gate, "mla_output_gate": mla.output_gate,
                 "kda_chunk": chunk.kda_chunk, "grouped_gemm": dispatch._grouped_mm_loop}
    # all_to_all runs only on P ranks, in the expert-parallel dispatch: tests/test_capstone.py swaps it there;
    # quantile_balance_bias only when training moves the bias (test_the_quantile_bias_part_moves_the_bias)
    assert set(originals) == set(PART_NAMES) - {"all_to_all", "quantile_balance_bias"}
    with use_parts(**{name: counting(fn, calls, name) for name, fn in originals.items()}):
        model(tokens(70))  # chunked path: kda_chunk, and inside it ut_transform
        model(tokens(5))  # recurrent path: kda_step
    assert set(calls) == set(originals), f"never called: {set(originals) - set(calls)}"
    report = compare(model, tokens(70), **originals)
    assert report.first is None and max(row.relative_error for row in report.rows) == 0


def test_the_quantile_bias_part_moves_the_bias():
    """quantile_balance_bias runs where training moves the bias: a learner's is called, and its bias is set."""
    from k3course.moe import LatentMoE

    layer = LatentMoE(16, 4, 2, generator=torch.Generator().manual_seed(0)).train()
    layer(torch.randn(12, 16, generator=torch.Generator().manual_seed(1)))
    with use_parts(quantile_balance_bias=lambda scores, bias, k: torch.full_like(bias, 0.25)):
        assert layer.update_bias()
    assert torch.equal(layer.bias, torch.full((4,), 0.25))


def lowest_scores_route(scores, k, bias=None, renormalize=True):
    """A wrong router: the k LOWEST biased scores."""
    return routing.topk_route(-scores, k, None if bias is None else -bias, renormalize)


def kda_step_without_decay(state, q, k, v, g, beta):
    return KDA_STEP(state, q, k, v, torch.zeros_like(g), beta)


def ut_transform_without_beta(A_kk, beta):
    return UT_TRANSFORM(A_kk, torch.ones_like(beta))


def depth_attention_uniform(query, sources, eps=1e-6):
    """A wrong depth attention: the plain mean over sources (ignores the query)."""
    return sources.mean(0), torch.full(sources.shape[:-1], 1 / sources.shape[0], dtype=sources.dtype)


@pytest.mark.parametrize("part, wrong, length, first", [
    ("topk_route", lowest_scores_route, 20, "layers.1.ffn"),  # layer 0 is dense: the first MoE is layer 1
    ("kda_step", kda_step_without_decay, 20, "layers.0.mixer"),  # short input at inference: recurrent path
    ("ut_transform", ut_transform_without_beta, 70, "layers.0.mixer"),  # longer than a chunk: chunked path
    ("situ_glu", lambda gate, up: experts.swiglu(gate, up), 20, "layers.0.ffn"),  # layer 0's dense FFN
    ("shared_experts", lambda x, *weights: 2 * experts.glu_ffn(x, *weights), 20, "layers.1.ffn"),
    ("short_conv", lambda x, weight, cache=None: kda_layer.short_conv(x, weight.flip(-1), cache), 20,
     "layers.0.mixer"),
    ("mla_output_gate", lambda heads, x, weight: heads, 20, "layers.3.mixer"),  # the tiny K3's MLA is layer 3
])
def test_compare_names_the_first_sub_layer_a_wrong_part_changes(model, part, wrong, length, first):
    report = compare(model, tokens(length), **{part: wrong})
    assert report.first is not None and report.first.name == first
    assert all(row.relative_error == 0 for row in report.rows[:[r.name for r in report.rows].index(first)])
    assert "first departure: " + first in str(report)


def test_a_wrong_depth_attention_departs_once_the_queries_have_trained(model):
    trained = K3Model.from_config(model.cfg)
    trained.load_state_dict(model.state_dict())
    with torch.no_grad():
        trained.residual.queries.normal_()  # zero queries ARE a uniform average: give them values first
    report = compare(trained, tokens(10), depth_attention=depth_attention_uniform)
    assert report.first is not None and report.first.name == "layers.0.ffn"  # the first read over two sources


def test_bad_parts_are_named(model):
    with pytest.raises(ValueError, match="unknown part"):
        with use_parts(top_k=lowest_scores_route):
            pass
    with pytest.raises(TypeError, match="kda_step must be a function"):
        with use_parts(kda_step=3):
            pass


def test_the_parts_enter_through_the_registry_not_by_patching_modules(model):
    """Inside use_parts every module still holds the package's function; the registry holds yours, nested blocks
    give the innermost one, and each block restores what was held before it."""
    import k3course.layers.residual as residual_module
    import k3course.moe.router as moe_router

    def mine(*args, **kwargs):
        return routing.topk_route(*args, **kwargs)

    def also_mine(*args, **kwargs):
        return routing.topk_route(*args, **kwargs)

    with use_parts(topk_route=mine, depth_attention=depth_attention_uniform):
        assert (moe_router.topk_route, chunk.ut_transform, recurrent.kda_step, residual_module.depth_attention) == (
            routing.topk_route, UT_TRANSFORM, KDA_STEP, depth_attention)
        assert registry.part("topk_route", routing.topk_route) is mine and registry.is_replaced("depth_attention")
        with use_parts(topk_route=also_mine):
            assert registry.part("topk_route", routing.topk_route) is also_mine
        assert registry.part("topk_route", routing.topk_route) is mine
    assert registry.part("topk_route", routing.topk_route) is routing.topk_route
    assert not any(registry.is_replaced(name) for name in registry.PART_NAMES)


def test_a_learners_ut_transform_is_differentiated_by_autograd_on_the_bounded_path():
    """K3's trained path (lower bound, gradient) has a written-out backward for the package's UT transform; with a
    learner's held, the op runs the autograd path through it, and gradients agree with the package's."""
    from k3course.ops.chunk import kda_chunk

    calls = {}
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 32, 2, 4, generator=g, dtype=torch.float64)
    gate = -torch.rand(1, 32, 2, 8, generator=g, dtype=torch.float64)
    beta = torch.rand(1, 32, 2, generator=g, dtype=torch.float64)

    def grads(**parts):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gate, beta)]
        with use_parts(**parts):
            o, _ = kda_chunk(*leaves, chunk_size=16, lower_bound=-5.0)
        o.square().sum().backward()
        return [x.grad for x in leaves]

    package = grads()
    learners = grads(ut_transform=counting(UT_TRANSFORM, calls, "ut_transform"))
    assert calls["ut_transform"] >= 1
    for mine, reference in zip(learners, package):
        torch.testing.assert_close(mine, reference)


def test_an_unknown_part_name_is_named():
    with pytest.raises(ValueError, match="name must be one of the swappable parts"):
        registry.part("top_k", routing.topk_route)
