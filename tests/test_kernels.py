"""Triton kernels (chapter 08) against plain per-token / per-expert loops written here, in fp64.

On a CPU they run under the Triton interpreter (fp32, small shapes); the same tests run natively on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from k3course.kernels import TRITON_MODE, kernel_backend, use_triton
from k3course.kernels.grouped_gemm import moe_grouped_gemm
from k3course.kernels.kda_chunk import chunk_local_cumsum, kda_chunk_triton
from k3course.kernels.kda_decode import kda_decode_triton

DEVICE = torch.device("cuda" if TRITON_MODE == "native" else "cpu")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def kda_inputs(B, T, H, K, V, seed, decay="random", dtype=torch.float32):
    """Seeded KDA inputs in the fla layout; k is L2-normalised, g ≤ 0 with K3's lower bound −5."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.full((B, T, H, K), -5.0) if decay == "strong" else -5 * torch.rand(B, T, H, K, generator=gen) ** 3
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return [x.to(DEVICE, dtype) for x in (q, k, v, g, beta)] + [h0.to(DEVICE)]


def kda_per_token(q, k, v, g, beta, scale, initial_state):
    """S ← Diag(e^g) S; S ← S + β k (v − Sᵀk)ᵀ; o = scale Sᵀq, token by token in fp64."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    state = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64, device=q.device)
    if initial_state is not None:
        state = state + initial_state.double()
    outputs = []
    for t in range(T):
        state = state * g[:, t].exp()[..., None]
        prediction = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t] * beta[:, t, :, None], v[:, t] - prediction)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    return torch.stack(outputs, dim=1), state


@pytest.mark.parametrize("T", [1, 64, 100, 256])
@pytest.mark.parametrize("with_state", [False, True])
def test_kda_chunk_triton_matches_the_recurrence_and_the_torch_rungs(T, with_state):
    """Against a per-token loop written here and the chapter 06/07 ops kda_recurrent and kda_chunk."""
    from k3course.ops import kda_chunk, kda_recurrent

    q, k, v, g, beta, h0 = kda_inputs(1, T, 2, 16, 16, seed=T)
    initial_state = h0 if with_state else None
    o, final = kda_chunk_triton(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
    assert o.dtype == v.dtype and final.dtype == torch.float32
    references = [kda_per_token(q, k, v, g, beta, 16 ** -0.5, initial_state)]
    references += [op(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
                   for op in (kda_chunk, kda_recurrent)]
    for want_o, want_state in references:
        assert relative_error(o, want_o) <= 1e-4
        assert relative_error(final, want_state) <= 1e-4


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_kda_chunk_triton_strong_decay_at_the_lower_bound(chunk_size):
    """g = −5 everywhere: e^{−G} over a chunk would overflow fp32; the kernels only take exponents ≤ 0."""
    q, k, v, g, beta, h0 = kda_inputs(2, 50, 1, 24, 20, seed=3, decay="strong")
    o, final = kda_chunk_triton(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                chunk_size=chunk_size)
    want_o, want_state = kda_per_token(q, k, v, g, beta, 0.3, h0)
    assert torch.isfinite(o).all()
    assert relative_error(o, want_o) <= 1e-4
    assert relative_error(final, want_state) <= 1e-4


def test_kda_chunk_triton_with_several_value_blocks_and_heads():
    """V = 80 spans several value blocks of every kernel; K = 40 is not a power of two."""
    q, k, v, g, beta, h0 = kda_inputs(2, 70, 3, 40, 80, seed=8)
    o, final = kda_chunk_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=32)
    want_o, want_state = kda_per_token(q, k, v, g, beta, 40 ** -0.5, h0)
    assert relative_error(o, want_o) <= 1e-4
    assert relative_error(final, want_state) <= 1e-4


def test_kda_chunk_triton_no_final_state_unless_asked():
    q, k, v, g, beta, _ = kda_inputs(1, 5, 1, 16, 16, seed=1)
    assert kda_chunk_triton(q, k, v, g, beta)[1] is None


def test_chunk_local_cumsum_restarts_every_chunk():
    g = kda_inputs(2, 37, 3, 16, 16, seed=5)[3]
    want = torch.cat([part.cumsum(1) for part in g.split(16, dim=1)], dim=1)
    assert relative_error(chunk_local_cumsum(g, 16), want) <= 1e-6


@pytest.mark.parametrize("T", [1, 3])
def test_kda_decode_matches_recurrent_steps_and_updates_state_in_place(T):
    q, k, v, g, beta, h0 = kda_inputs(2, T, 2, 16, 20, seed=7)
    state = h0.clone()
    o, returned = kda_decode_triton(q, k, v, g, beta, state)
    want_o, want_state = kda_per_token(q, k, v, g, beta, 16 ** -0.5, h0)
    assert returned is state
    assert relative_error(o, want_o) <= 1e-5
    assert relative_error(state, want_state) <= 1e-5


def test_decode_continues_a_chunked_prefill():
    """Prefill 40 tokens with the chunk kernel, decode 2 more: same as the chunk kernel over all 42."""
    q, k, v, g, beta, _ = kda_inputs(1, 42, 2, 16, 16, seed=11)
    _, state = kda_chunk_triton(*(x[:, :40] for x in (q, k, v, g, beta)), output_final_state=True)
    o_decode, _ = kda_decode_triton(*(x[:, 40:] for x in (q, k, v, g, beta)), state)
    o_all, _ = kda_chunk_triton(q, k, v, g, beta)
    assert relative_error(o_decode, o_all[:, 40:]) <= 1e-5


def test_kda_kernels_reject_bad_input():
    q, k, v, g, beta, h0 = kda_inputs(1, 8, 1, 16, 16, seed=0)
    from k3course import debug

    with debug.value_checks(), pytest.raises(ValueError, match="g must be a log-decay"):
        kda_chunk_triton(q, k, v, -g, beta)
    with debug.value_checks(), pytest.raises(ValueError, match="v contain"):
        kda_chunk_triton(q, k, v.clone().index_fill_(1, torch.tensor([3], device=DEVICE), float("nan")), g, beta)
    with pytest.raises(ValueError, match="beta must be"):
        kda_chunk_triton(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunk_triton(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunk_triton(q, k, v, g, beta, initial_state=h0[:, :, :8])
    with pytest.raises(TypeError, match="state must be a contiguous fp32"):
        kda_decode_triton(q, k, v, g, beta, h0.double())


def per_expert_loop(x, weights, ends):
    """The reference: one fp64 matmul per expert on its block of rows."""
    out, start = [], 0
    for expert, end in enumerate(ends.tolist()):
        out.append(x[start:end].double() @ weights[expert].double())
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("counts", [[5, 0, 17, 1, 0, 40, 3], [0, 0, 9, 0], [33], [0, 4, 0]])
def test_grouped_gemm_matches_per_expert_loop_with_empty_experts(counts):
    gen = torch.Generator().manual_seed(len(counts))
    ends = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    x = torch.randn(sum(counts), 24, generator=gen).to(DEVICE).requires_grad_()
    weights = torch.randn(len(counts), 24, 40, generator=gen).to(DEVICE).requires_grad_()
    out = moe_grouped_gemm(x, weights, ends)
    want = per_expert_loop(x, weights, ends)
    assert out.shape == (sum(counts), 40) and out.dtype == x.dtype
    assert relative_error(out, want) <= 1e-5
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
    grad_x, grad_w = torch.autograd.grad(out, (x, weights), grad_out)
    want_x, want_w = torch.autograd.grad(want, (x, weights), grad_out.double())
    assert relative_error(grad_x, want_x) <= 1e-5
    assert relative_error(grad_w, want_w) <= 1e-5


def test_grouped_gemm_reads_strided_weights():
    gen = torch.Generator().manual_seed(2)
    ends = torch.tensor([3, 3, 20], dtype=torch.int32, device=DEVICE)
    x = torch.randn(20, 16, generator=gen).to(DEVICE)
    stored = torch.randn(3, 48, 16, generator=gen).to(DEVICE)  # [E, N, K]: used through its transpose
    out = moe_grouped_gemm(x, stored.transpose(1, 2), ends)
    assert relative_error(out, per_expert_loop(x, stored.transpose(1, 2), ends)) <= 1e-5


def test_grouped_gemm_rejects_bad_input():
    x, weights = torch.zeros(6, 8, device=DEVICE), torch.zeros(2, 8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="group_offsets must be"):
        moe_grouped_gemm(x, weights, torch.tensor([6], device=DEVICE))
    with pytest.raises(ValueError, match="expert_weights must be"):
        moe_grouped_gemm(x, weights[:, :4], torch.tensor([2, 6], device=DEVICE))
    with pytest.raises(TypeError, match="integer"):
        moe_grouped_gemm(x, weights, torch.tensor([2.0, 6.0], device=DEVICE))


def test_use_triton_auto_follows_the_device(monkeypatch):
    monkeypatch.delenv("K3COURSE_KERNELS", raising=False)
    assert kernel_backend() == "auto"
    assert use_triton("cpu", "auto") is False
    assert use_triton("cuda", "auto") is (TRITON_MODE == "native")


def test_the_kernel_backend_is_the_argument_else_the_environment_and_forces_either_path(monkeypatch):
    monkeypatch.setenv("K3COURSE_KERNELS", "triton")
    assert kernel_backend() == "triton" and kernel_backend("torch") == "torch"  # the argument wins
    assert use_triton("cpu", "triton") is True
    assert use_triton("cuda", "torch") is False and use_triton("cuda", "loop") is False
    monkeypatch.setenv("K3COURSE_KERNELS", "fast")
    with pytest.raises(ValueError, match="K3COURSE_KERNELS must be one of"):
        kernel_backend()
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernel_backend("fast")
    with pytest.raises(ValueError, match="backend must be one of"):
        use_triton("cpu", "fast")


def test_a_model_reads_the_environment_once_when_it_is_built(monkeypatch):
    from k3course.config import K3Config
    from k3course.model import K3Model

    monkeypatch.setenv("K3COURSE_KERNELS", "torch")
    model = K3Model.from_config(K3Config.preset("tiny"), device="meta")
    monkeypatch.setenv("K3COURSE_KERNELS", "triton")  # too late for that model
    chosen = {layer.mixer.kernels for layer in model.layers if layer.mixer_kind == "kda"}
    assert model.kernels == "torch" and chosen == {"torch"}
    assert {moe.experts.kernels for moe in model.moe_layers()} == {"torch"}
    assert K3Model.from_config(K3Config.preset("tiny"), device="meta", kernels="loop").moe_layers()[0].experts.kernels \
        == "loop"


def test_kda_chunk_triton_matches_the_fla_oracle():
    """An independent reference this repo did not write (fla's naive recurrence); skipped without fla."""
    naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, g, beta, h0 = kda_inputs(2, 70, 2, 16, 24, seed=9)
    o, final = kda_chunk_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    want_o, want_state = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert relative_error(o, want_o) <= 1e-4
    assert relative_error(final, want_state) <= 1e-4


def test_kernels_benchmark_explains_what_it_skips_on_cpu(capsys):
    from k3course.bench import kernels as bench

    if torch.cuda.is_available():
        pytest.skip("on a GPU the benchmark runs for real (minutes); run `k3course bench kernels`")
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "needs a CUDA GPU" in out and "Skipped" in out and "torch._grouped_mm" in out


def test_benchmark_accounting():
    from k3course.bench.kernels import grouped_gemm_flops, kda_forward_flops, roofline_tflops

    assert grouped_gemm_flops(10, 4, 8) == 640
    # per chunk of C: 6 C K V + 8 C² K-or-V terms + C³/3; T = C, one head, K = V = d
    assert kda_forward_flops(1, 64, 1, 128, 128, 64) == pytest.approx(6 * 64 * 128 ** 2 + 10 * 64 ** 2 * 128
                                                                      + 64 ** 3 / 3)
    assert roofline_tflops(1e12, 1e9, "NVIDIA H100 80GB HBM3") == pytest.approx(989.0)  # compute bound
    assert roofline_tflops(1e9, 1e9, "NVIDIA H100 80GB HBM3") == pytest.approx(3.35)  # memory bound
    assert roofline_tflops(1e9, 1e9, "a laptop") is None


def test_error_ratio_is_fla_metric():
    from k3course.bench.kernels import error_ratio

    want = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert error_ratio(want, want) == 0.0
    # rms of the error 0.05 / √2 over rms of the reference √12.5
    assert error_ratio(want + torch.tensor([0.0, 0.05], dtype=torch.float64), want) == pytest.approx(0.01, rel=1e-9)


@pytest.mark.skipif(TRITON_MODE != "native", reason="bf16 needs a GPU (the interpreter is wrong in bf16)")
def test_bf16_forward_within_fla_tolerance_on_gpu():
    from k3course.bench.kernels import FLA_BF16_TOLERANCE, Workload, check_bf16_accuracy

    assert check_bf16_accuracy(Workload(accuracy_len=1024)) <= FLA_BF16_TOLERANCE


@pytest.mark.parametrize("T", [1, 21])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_kda_triton_runs_the_path_asked_and_leaves_the_callers_state(T, requires_grad, chunked):
    from k3course.kernels.kda import kda_triton

    q, k, v, g, beta, h0 = kda_inputs(1, T, 2, 16, 16, seed=12)
    q.requires_grad_(requires_grad)
    before = h0.clone()
    o, final = kda_triton(q, k, v, g, beta, initial_state=h0, chunked=chunked, chunk_size=16)
    want_o, want_state = kda_per_token(q.detach(), k, v, g, beta, 16 ** -0.5, h0)
    assert torch.equal(h0, before)
    assert o.requires_grad == requires_grad
    assert relative_error(o, want_o) <= 1e-4 and relative_error(final, want_state) <= 1e-4


def test_intermediate_traffic_accounting():
    from k3course.bench.kernels import kda_intermediate_bytes

    parts = kda_intermediate_bytes(1, 64, 1, 128, 128, 64, element=4)  # fp32 data: everything fp32
    assert parts["G (in-chunk cumulative decay)"] == 64 * 128 * 4 * 5
    assert parts["states entering each chunk"] == 128 * 128 * 4 * 2  # one chunk: one state, written and read
    assert sum(parts.values()) == 64 * 4 * (5 * 128 + 4 * 64 + 2 * 256 + 2 * 128) + 128 * 128 * 8
    bf16 = kda_intermediate_bytes(1, 64, 1, 128, 128, 64)
    assert bf16["G (in-chunk cumulative decay)"] == parts["G (in-chunk cumulative decay)"]
    assert bf16["W and U"] == parts["W and U"] / 2


def test_importing_triton_first_on_cpu_is_reported():
    """On a CPU, triton imported before k3course.kernels leaves tl.sum & co. unusable by the interpreter."""
    import os
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = ("import warnings; warnings.simplefilter('error'); import triton.language; import k3course.kernels; "
              "k3course.kernels.select_triton_mode()")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    if TRITON_MODE == "native":
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode != 0 and "select_triton_mode() before importing triton" in run.stderr


def test_kda_kernels_compute_offsets_in_int64():
    """Every KDA kernel casts its batch·head program id to int64 before any offset is formed: at K3's size
    (T = 1M, H = 96, K = 128) the element offset (b·T + t)·H·K passes 2^31. The kernels run at small sizes in
    the other tests; here the code is checked (no tensor of 2^31 elements is allocated)."""
    import inspect

    from k3course.kernels import kda_chunk, kda_decode

    kernels = [getattr(module, name) for module in (kda_chunk, kda_decode) for name in dir(module)
               if name.endswith("_kernel")]
    assert len(kernels) == 6
    for kernel in kernels:
        source = inspect.getsource(kernel.fn)
        cast, split = source.find("bh = bh.to(tl.int64)"), source.find("b, h = bh // H, bh % H")
        assert 0 <= cast < split, f"{kernel.fn.__name__}: program id not cast to int64 before the offsets"
    assert 96 * 128 * (1 << 20) > 2 ** 31  # T·H·K at K3's size: int32 offsets would wrap
