"""The layers choose their path with ``k3course.kernels.use_triton``: torch on a CPU, Triton on a GPU, and the
``K3COURSE_KERNELS`` switch forces either. On a CPU the forced Triton path runs under the interpreter (fp32)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import k3course.kernels.grouped_gemm as grouped_gemm_module  # noqa: E402
import k3course.kernels.kda as kda_module  # noqa: E402
from k3course.kernels import TRITON_MODE  # noqa: E402
from k3course.layers.kda import KimiDeltaAttention  # noqa: E402
from k3course.moe import LatentMoE  # noqa: E402
from k3course.moe.dispatch import grouped_mm  # noqa: E402

DEVICE = torch.device("cuda" if TRITON_MODE == "native" else "cpu")


@pytest.fixture
def triton_calls(monkeypatch):
    """Count the calls that reach the Triton entry points (the layers import them at call time)."""
    calls = {"kda": 0, "grouped_gemm": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(kda_module, "kda_triton", counting("kda", kda_module.kda_triton))
    monkeypatch.setattr(grouped_gemm_module, "moe_grouped_gemm",
                        counting("grouped_gemm", grouped_gemm_module.moe_grouped_gemm))
    return calls


def small_kda_layer():
    torch.manual_seed(0)
    return KimiDeltaAttention(d_model=32, n_heads=2, head_dim=16, chunk_size=16).to(DEVICE)


def test_kda_layer_uses_torch_on_cpu_by_default(monkeypatch, triton_calls):
    monkeypatch.delenv("K3COURSE_KERNELS", raising=False)
    x = torch.randn(1, 20, 32, generator=torch.Generator().manual_seed(1))
    small_kda_layer()(x)
    assert triton_calls["kda"] == 0


def test_kda_layer_forced_triton_matches_forced_torch(monkeypatch, triton_calls):
    layer = small_kda_layer()
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    layer.kernels = "torch"
    y_torch, state_torch = layer(x)
    assert triton_calls["kda"] == 0
    layer.kernels = "triton"
    y_triton, state_triton = layer(x)
    assert triton_calls["kda"] == 1
    torch.testing.assert_close(y_triton, y_torch, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state_triton.state, state_torch.state, rtol=1e-4, atol=1e-5)


def test_kda_layer_triton_decodes_token_by_token(monkeypatch, triton_calls):
    """Prefill with the chunk kernels, then one token at a time through the fused decode step (no grad)."""
    layer = small_kda_layer()
    x = torch.randn(1, 19, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    layer.kernels = "triton"
    with torch.no_grad():
        y_whole, _ = layer(x)
        y_prefix, state = layer(x[:, :16])
        steps = []
        for t in range(16, 19):
            y_t, state = layer(x[:, t:t + 1], state)
            steps.append(y_t)
    assert triton_calls["kda"] == 5
    torch.testing.assert_close(torch.cat([y_prefix, *steps], dim=1), y_whole, rtol=1e-4, atol=1e-5)


def test_grouped_mm_selects_the_triton_kernel_when_switched(monkeypatch, triton_calls):
    gen = torch.Generator().manual_seed(4)
    ends = torch.tensor([3, 3, 11, 16], dtype=torch.int32, device=DEVICE)
    x, weight = torch.randn(16, 8, generator=gen).to(DEVICE), torch.randn(4, 8, 24, generator=gen).to(DEVICE)
    monkeypatch.setenv("K3COURSE_KERNELS", "triton")  # read by a model's build, never by a dispatch
    want = grouped_mm(x, weight, ends, impl="loop")
    assert triton_calls["grouped_gemm"] == 0
    torch.testing.assert_close(grouped_mm(x, weight, ends, impl="triton"), want, rtol=1e-5, atol=1e-5)
    assert triton_calls["grouped_gemm"] == 1


def test_moe_layer_forced_triton_matches_torch_forward_and_backward(monkeypatch, triton_calls):
    layer = LatentMoE(32, 8, 2, expert_dim=16, generator=torch.Generator().manual_seed(5)).to(DEVICE).eval()
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    results = {}
    for switch in ("torch", "triton"):
        layer.experts.kernels = switch
        layer.zero_grad()
        y = layer(x)
        y.square().sum().backward()
        results[switch] = (y.detach(), layer.experts.down.grad.clone())
    assert triton_calls["grouped_gemm"] >= 2  # gate|up and down projections
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results["triton"][1], results["torch"][1], rtol=1e-4, atol=1e-5)


# --- the Triton branch of the KDA layer honours what the torch branch honours --------------------------------


def test_triton_chunk_op_clamps_at_lower_bound_like_the_torch_op():
    from k3course.kernels.kda_chunk import kda_chunk_triton
    from k3course.ops.chunk import kda_chunk

    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 20, 1, 16, generator=gen).to(DEVICE) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    g = (-2 * torch.rand(1, 20, 1, 16, generator=gen)).to(DEVICE)  # half of it below the bound -1
    beta = torch.rand(1, 20, 1, generator=gen).to(DEVICE)
    results = []
    for op in (kda_chunk, kda_chunk_triton):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        o, state = op(*leaves, output_final_state=True, chunk_size=16, lower_bound=-1.0)
        (o.square().sum() + state.sum()).backward()
        results.append([o.detach(), state.detach(), *(t.grad for t in leaves)])
    for got, want in zip(*reversed(results)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (g < -1).any() and (results[1][5][g < -1] == 0).all(), "no gradient reaches g below the bound"
    with pytest.raises(ValueError, match="lower_bound must be None or a negative finite number"):
        kda_chunk_triton(q, k, v, g, beta, lower_bound=0.5)


@pytest.mark.parametrize("bad", [dict(chunk_size=8), dict(chunk_size=48), dict(chunk_size=0), dict(mode="fast")])
def test_kda_layer_rejects_a_bad_chunk_size_or_mode_alike_on_both_backends(monkeypatch, bad):
    x = torch.randn(1, 20, 32).to(DEVICE)
    messages = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("K3COURSE_KERNELS", backend)
        with pytest.raises(ValueError) as error:
            KimiDeltaAttention(32, 2, 16, **bad).to(DEVICE)(x)
        messages[backend] = str(error.value)
    assert messages["torch"] == messages["triton"] and next(iter(bad)) in messages["torch"]


@pytest.mark.parametrize("mode, tokens, grad, kernel", [("chunk", 1, False, "chunk"),
                                                        ("recurrent", 20, False, "fused recurrent"),
                                                        ("recurrent", 20, True, "torch recurrent"),
                                                        ("auto", 20, True, "chunk")])
def test_kda_layer_triton_branch_follows_the_layers_mode(monkeypatch, mode, tokens, grad, kernel):
    """The path is the layer's (mode, training, length), on Triton as on torch; the fused kernel has no backward,
    so a recurrent path that needs gradients takes the torch recurrent op."""
    calls = []
    for name, label in (("kda_chunk_triton", "chunk"), ("kda_decode_triton", "fused recurrent"),
                        ("kda_recurrent", "torch recurrent")):
        fn = getattr(kda_module, name)
        monkeypatch.setattr(kda_module, name, lambda *a, fn=fn, label=label, **kw: calls.append(label) or fn(*a, **kw))
    torch.manual_seed(0)
    layer = KimiDeltaAttention(32, 2, 16, chunk_size=16, mode=mode).to(DEVICE).train(grad)
    x = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    outputs = {}
    for backend in ("torch", "triton"):
        layer.kernels = backend
        with torch.set_grad_enabled(grad):
            outputs[backend] = layer(x)[0]
    assert calls == [kernel]
    torch.testing.assert_close(outputs["triton"], outputs["torch"], rtol=1e-4, atol=1e-5)
