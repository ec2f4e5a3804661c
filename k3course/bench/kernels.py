"""``k3course bench kernels``: the chapter-08 Triton kernels against the best public peers (GPU only).

Rows:
- KDA chunk forward (and forward + backward) at B = 1, T ∈ {2048, 8192, 32768}, H = 16, K = V = 128, bf16:
  ours (``kda_chunk_triton``) vs fla's ``chunk_kda`` (when installed) vs the torch chunked path.
- MoE grouped GEMM at K3-like shapes (ℓ = 3584 → expert width 3072 by default; ``--scale`` shrinks both),
  64 and 128 experts, top-8 and top-16: ours (``moe_grouped_gemm``) vs ``torch._grouped_mm`` vs a per-expert loop.

Each row gives milliseconds (``triton.testing.do_bench``, median), TFLOP/s, the percentage of the GPU's
roofline (min(peak FLOP/s, arithmetic intensity × memory bandwidth) for the GPUs in ``PEAKS``) and the ratio
of our throughput to the peer's (> 1: ours is faster). On a CPU there is nothing meaningful to time (the
Triton interpreter is ~2000× slower than torch), so it says what it skipped and exits 0.
"""

from __future__ import annotations

import argparse

import torch

# Dense bf16 tensor-core peak (TFLOP/s) and HBM bandwidth (TB/s), from the vendors' data sheets (SXM parts).
PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989.0, 4.8),
    "H100": (989.0, 3.35),
    "B200": (2250.0, 8.0),
    "A100": (312.0, 2.0),
    "L40S": (362.0, 0.864),
}


def kda_forward_flops(B: int, T: int, H: int, K: int, V: int, chunk: int) -> float:
    """FLOPs of the chunkwise forward, counted matmul by matmul (2 per multiply-add), per chunk of C tokens:
    A_kk and A_qk 2·C²K each, the inverse C³/3, W 2C²K, U 2C²V, Ṽ = U − WS 2CKV, the state update 2CKV,
    (ΓQ)S 2CKV, A_qk Ṽ 2C²V."""
    C = chunk
    per_chunk = 4 * C * C * K + C ** 3 / 3 + 2 * C * C * K + 2 * C * C * V + 6 * C * K * V + 2 * C * C * V
    return B * H * (T / C) * per_chunk


def kda_forward_bytes(B: int, T: int, H: int, K: int, V: int, element: int = 2) -> float:
    """The unavoidable traffic: read q, k, g, v, β and write o once."""
    return B * T * H * (3 * K + 2 * V + 1) * element


def kda_intermediate_bytes(B: int, T: int, H: int, K: int, V: int, chunk: int, element: int = 2) -> dict[str, float]:
    """Bytes of the intermediates our five kernels write and read back (each written once, read by every kernel
    that uses it): G (fp32, read by 4 kernels), A_kk (fp32), and in the data's ``element`` size A_qk, W, U, Ṽ
    and the state entering each chunk."""
    tokens, f32 = B * T * H, 4
    return {
        "G (in-chunk cumulative decay)": tokens * K * f32 * 5,
        "A_kk and A_qk": tokens * chunk * (f32 + element) * 2,
        "W and U": tokens * (K + V) * element * 2,
        "V~ (corrected values)": tokens * V * element * 2,
        "states entering each chunk": B * H * (T / chunk) * K * V * element * 2,
    }


def grouped_gemm_flops(rows: int, k: int, n: int) -> float:
    return 2.0 * rows * k * n


def grouped_gemm_bytes(rows: int, k: int, n: int, experts: int, element: int = 2) -> float:
    return (rows * k + experts * k * n + rows * n) * element


def roofline_tflops(flops: float, nbytes: float, name: str) -> float | None:
    """The attainable TFLOP/s for this arithmetic intensity on GPU ``name``, or None for an unknown GPU."""
    for key, (peak, bandwidth) in PEAKS.items():
        if key in name:
            return min(peak, flops / nbytes * bandwidth)
    return None


def _row(label: str, ms: float | None, flops: float, nbytes: float, gpu: str) -> str:
    if ms is None:
        return f"{label:<44} {'n/a':>9}"
    tflops = flops / ms / 1e9
    roof = roofline_tflops(flops, nbytes, gpu)
    roof_text = f"{100 * tflops / roof:5.1f}%" if roof else "   n/a"
    return f"{label:<44} {ms:9.3f} {tflops:9.1f} {roof_text:>9}"


def _time(fn) -> float | None:
    """Median milliseconds, or None when the call fails (e.g. an op this GPU or torch build lacks)."""
    import triton.testing

    try:
        fn()
        return triton.testing.do_bench(fn, warmup=10, rep=50)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        print(f"    (skipped: {type(error).__name__}: {str(error).splitlines()[0][:100]})")
        return None


def error_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖_rms / ‖want‖_rms: the metric of fla's tests (they accept ≤ 0.005 for bf16 KDA outputs)."""
    got, want = got.double(), want.double()
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def check_bf16_accuracy(T: int = 2048) -> float:
    """bf16 Triton forward vs the fp32 torch chunked path on the same (bf16-rounded) inputs; prints and returns
    the error ratio."""
    from k3course.attention import kda_chunk
    from k3course.kernels.kda_chunk import kda_chunk_triton

    inputs = _kda_inputs(T, 16, 128, 128, requires_grad=False)
    o_bf16, _ = kda_chunk_triton(*inputs)
    o_fp32, _ = kda_chunk(*(x.float() for x in inputs))
    ratio = error_ratio(o_bf16, o_fp32)
    verdict = "within" if ratio <= FLA_BF16_TOLERANCE else "OUTSIDE"
    print(f"bf16 forward vs fp32 reference at T={T}: error ratio {ratio:.2e} ({verdict} fla's {FLA_BF16_TOLERANCE})")
    return ratio


FLA_BF16_TOLERANCE = 0.005


def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def _kda_inputs(T: int, H: int, K: int, V: int, requires_grad: bool):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device="cuda", generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = -5 * torch.sigmoid(torch.randn(1, T, H, K, device="cuda", generator=gen))  # K3's bounded gate
    beta = torch.sigmoid(torch.randn(1, T, H, device="cuda", generator=gen))
    inputs = [q, k.bfloat16(), v, g.bfloat16(), beta.bfloat16()]
    return [x.requires_grad_(requires_grad) for x in inputs]


def bench_kda(seq_lens: list[int], gpu: str, backward: bool) -> None:
    from k3course.attention import kda_chunk
    from k3course.kernels.kda_chunk import kda_chunk_triton

    fla_kda = _fla_chunk_kda()
    H, K, V, C = 16, 128, 128, 64
    what = "forward + backward" if backward else "forward"
    print(f"\nKDA chunk {what}, B=1 H={H} K=V={K} bf16 (ratios: peer ms / our ms)")
    print(f"{'row':<44} {'ms':>9} {'TFLOP/s':>9} {'roofline':>9}")
    for T in seq_lens:
        _kda_rows(T, H, K, V, C, gpu, backward, [("ours (Triton)", kda_chunk_triton),
                                                 ("fla chunk_kda" + ("" if fla_kda else " (not installed)"), fla_kda),
                                                 ("torch chunked (k3course)", kda_chunk)])


def _kda_rows(T, H, K, V, C, gpu, backward, contenders) -> None:
    """Time each (label, fn) on the same inputs; print its row and our ratio against each peer."""
    inputs = _kda_inputs(T, H, K, V, backward)
    flops = kda_forward_flops(1, T, H, K, V, C) * (3 if backward else 1)  # backward ≈ 2× the forward
    nbytes = kda_forward_bytes(1, T, H, K, V) * (3 if backward else 1)

    def call(fn):
        o, _ = fn(*inputs)
        if backward:
            o.float().sum().backward()

    times = {label: _time(lambda fn=fn: call(fn)) if fn else None for label, fn in contenders}
    ours = times[contenders[0][0]]
    for label, ms in times.items():
        print(_row(f"T={T:<6} {label}", ms, flops, nbytes, gpu))
    for label, ms in list(times.items())[1:]:
        if ours and ms:
            print(f"    ours vs {label}: {ms / ours:.2f}× the throughput (target vs fla: ≥ 0.8× at T = 8192)")


def bench_kda_breakdown(T: int, gpu: str) -> None:
    """Time each of the five forward kernels alone at one length: where the forward's time goes."""
    from k3course.kernels import kda_chunk as tri

    q, k, v, g, beta = _kda_inputs(T, 16, 128, 128, requires_grad=False)
    scale, C = 128 ** -0.5, 64
    gc = tri.chunk_local_cumsum(g, C)
    akk, aqk = tri.intra_chunk_scores(q, k, gc, beta, scale, C)
    w, u = tri.wy_factors(k, v, gc, beta, akk, C)
    states, v_new, _ = tri.pass_states(k, gc, w, u, None, False, C)
    steps = [("1   cumulative decay", lambda: tri.chunk_local_cumsum(g, C)),
             ("2,6 intra-chunk scores", lambda: tri.intra_chunk_scores(q, k, gc, beta, scale, C)),
             ("3,4 UT transform, W and U", lambda: tri.wy_factors(k, v, gc, beta, akk, C)),
             ("5,8 state passing (sequential)", lambda: tri.pass_states(k, gc, w, u, None, False, C)),
             ("7   output", lambda: tri.chunk_outputs(q, gc, states, v_new, aqk, scale, v.dtype, C))]
    print(f"\nKDA forward, kernel by kernel at T={T} (B=1 H=16 K=V=128 bf16)")
    for label, fn in steps:
        ms = _time(fn)
        print(f"  step {label:<34} {ms:8.3f} ms" if ms else f"  step {label:<34}      n/a")


def _routed_groups(tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """End offsets of each expert's rows for uniform random top-k routing (seeded)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    scores = torch.rand(tokens, experts, device="cuda", generator=gen)
    expert_idx = scores.topk(top_k, dim=-1).indices
    return torch.bincount(expert_idx.reshape(-1), minlength=experts).cumsum(0).to(torch.int32)


def bench_grouped_gemm(gpu: str, scale: int, tokens: int) -> None:
    d_in, d_out = 3584 // scale, 3072 // scale
    print(f"\nMoE grouped GEMM, [rows, {d_in}] @ [E, {d_in}, {d_out}], {tokens} tokens, bf16")
    print(f"{'row':<44} {'ms':>9} {'TFLOP/s':>9} {'roofline':>9}")
    for experts, top_k in ((64, 8), (128, 16)):
        _grouped_gemm_rows(gpu, tokens, experts, top_k, d_in, d_out)


def _grouped_gemm_rows(gpu: str, tokens: int, experts: int, top_k: int, d_in: int, d_out: int) -> None:
    from k3course.kernels.grouped_gemm import moe_grouped_gemm
    from k3course.moe.dispatch import grouped_mm

    ends = _routed_groups(tokens, experts, top_k)
    rows = tokens * top_k
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(rows, d_in, device="cuda", generator=gen, dtype=torch.bfloat16)
    weights = torch.randn(experts, d_in, d_out, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    flops, nbytes = grouped_gemm_flops(rows, d_in, d_out), grouped_gemm_bytes(rows, d_in, d_out, experts)
    ours = _time(lambda: moe_grouped_gemm(x, weights, ends))
    peer = _time(lambda: torch._grouped_mm(x, weights, offs=ends)) if hasattr(torch, "_grouped_mm") else None
    loop = _time(lambda: grouped_mm(x, weights, ends, backend="loop"))
    label = f"E={experts} top-{top_k}"
    print(_row(f"{label:<14} ours (one launch)", ours, flops, nbytes, gpu))
    print(_row(f"{label:<14} torch._grouped_mm", peer, flops, nbytes, gpu))
    print(_row(f"{label:<14} per-expert loop", loop, flops, nbytes, gpu))
    if ours and peer:
        print(f"    ours vs torch._grouped_mm: {peer / ours:.2f}× the throughput (target ≥ 0.8×)")
    if ours and loop:
        print(f"    ours vs per-expert loop: {loop / ours:.2f}×")


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768], help="KDA lengths T")
    parser.add_argument("--no-backward", action="store_true", help="skip the KDA forward + backward rows")
    parser.add_argument("--scale", type=int, default=1, help="divide the GEMM widths 3584 → 3072 by this")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens routed through the grouped GEMM")
    parser.add_argument("--quick", action="store_true",
                        help="the acceptance rows only (a few minutes): accuracy, forward at T = 8192, the GEMMs")
    args = parser.parse_args(options)
    if args.quick:
        args.seq_lens, args.no_backward = [8192], True
    return args


def explain_cpu_skip() -> str:
    return ("k3course bench kernels needs a CUDA GPU: on a CPU the Triton kernels run under the interpreter, "
            "about 2000× slower than torch,\nso their timings say nothing about the kernels. Skipped: KDA chunk "
            "forward and forward + backward at B=1, T ∈ {2048, 8192, 32768},\nH=16, K=V=128, bf16 (ours vs fla "
            "chunk_kda vs the torch chunked path); MoE grouped GEMM at ℓ=3584 → 3072 with 64 and 128\nexperts, "
            "top-8 and top-16 (ours vs torch._grouped_mm vs a per-expert loop). Correctness on CPU: "
            "pytest tests/test_kernels.py.")


def main(options: list[str]) -> int:
    args = _options(options)
    if not torch.cuda.is_available():
        print(explain_cpu_skip())
        return 0
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; roofline peaks (bf16 TFLOP/s, TB/s): {roofline_peaks_text(gpu)}")
    check_bf16_accuracy()
    bench_kda(args.seq_lens, gpu, backward=False)
    bench_kda_breakdown(8192, gpu)
    if not args.no_backward:
        bench_kda(args.seq_lens, gpu, backward=True)
    bench_grouped_gemm(gpu, args.scale, args.tokens)
    return 0


def roofline_peaks_text(gpu: str) -> str:
    for key, (peak, bandwidth) in PEAKS.items():
        if key in gpu:
            return f"{peak:g}, {bandwidth:g}"
    return "unknown GPU, roofline column n/a"
