"""``k3course bench kernels``: the chapter-08 Triton kernels against the best public peers (GPU only).

Rows:
- KDA chunk forward (and forward + backward) at B = 1, T ∈ {2048, 8192, 32768}, H = 16, K = V = 128, bf16:
  ours (``kda_chunk_triton``) vs fla's ``chunk_kda`` (when installed) vs the torch chunked path.
- KDA decode, one token per sequence at batch 1, 16, 64: ours (``kda_decode_triton``, the state updated in
  place) vs fla's ``fused_recurrent_kda`` vs the torch step; memory-bound, so its roofline is bandwidth.
- MoE grouped GEMM at K3-like shapes (ℓ = 3584 → expert width 3072 by default; ``--scale`` shrinks both),
  64 and 128 experts, top-8 and top-16, forward and forward + backward: ours (``moe_grouped_gemm``) vs
  ``torch._grouped_mm`` vs a per-expert loop.

Each row (a dict, see :func:`measure`) gives milliseconds (``triton.testing.do_bench``, median), TFLOP/s, the
percentage of the GPU's roofline (min(peak FLOP/s, arithmetic intensity × memory bandwidth) for the GPUs in
``PEAKS``) and the ratio of our throughput to the peer's (> 1: ours is faster). On a CPU there is nothing
meaningful to time (the Triton interpreter is orders of magnitude slower than torch), so it says what it skipped
and exits 0. ``k3course bench gpu`` runs these rows at a shorter sweep together with the kernel tests and saves
them. ``--threads`` and ``--return-freed-memory`` (shared by every bench) set the host side.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from k3course.bench import add_options, apply_options
from k3course.device import best_seconds

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


@dataclass(frozen=True)
class Workload:
    """The shapes and dtype the GPU benchmarks run at. The defaults are one GPU's slice of K3: B = 1, H = 16
    heads of K = V = 128, bf16; expert GEMMs at ℓ = 3584 → 3072 with 64 and 128 experts, top-8 and top-16."""

    seq_lens: tuple[int, ...] = (2048, 8192, 32768)
    heads: int = 16
    head_dim: int = 128
    chunk: int = 64
    decode_batches: tuple[int, ...] = (1, 16, 64)
    gemm_tokens: int = 4096
    gemm_dims: tuple[int, int] = (3584, 3072)
    gemm_experts: tuple[tuple[int, int], ...] = ((64, 8), (128, 16))
    breakdown_len: int | None = 8192  # the length of the kernel-by-kernel rows (None: no breakdown)
    accuracy_len: int = 2048  # the length of the low-precision accuracy check
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"


def measure(case: str, contenders: list[tuple[str, Callable | None]], flops: float | None, nbytes: float | None,
            gpu: str, device: str, targets: dict[str, str] | None = None) -> list[dict]:
    """Time each (impl, fn) of one case on the same inputs; one row per impl: {"case", "impl", "ms", "tflops",
    "roofline_pct", "vs_ours", "target"}, where vs_ours = peer ms / our ms (> 1: ours is faster), the first
    contender is ours and ``targets`` maps a peer's impl to the ratio we aim for against it. fn None (a peer
    that is not installed) or a failing call gives ms None; flops None (a row timed for where the time goes,
    not for its rate) gives tflops and roofline None."""
    times = {impl: _time(fn, device) if fn else None for impl, fn in contenders}
    ours = times[contenders[0][0]]
    rows = []
    for impl, ms in times.items():
        tflops = flops / ms / 1e9 if ms and flops else None
        roof = roofline_tflops(flops, nbytes, gpu) if flops and nbytes else None
        rows.append({"case": case, "impl": impl, "ms": ms, "tflops": tflops,
                     "roofline_pct": 100 * tflops / roof if tflops and roof else None,
                     "vs_ours": ms / ours if ms and ours and impl != contenders[0][0] else None,
                     "target": (targets or {}).get(impl, "")})
    return rows


def print_rows(rows: list[dict]) -> None:
    """The rows of :func:`measure` as a table: ms, TFLOP/s, % of roofline, and each peer against ours."""
    print(f"{'case':<30} {'implementation':<28} {'ms':>9} {'TFLOP/s':>9} {'roofline':>9}  peer ms / our ms")
    for row in rows:
        numbers = [f"{row['ms']:9.3f}" if row["ms"] else f"{'n/a':>9}",
                   f"{row['tflops']:9.2f}" if row["tflops"] else f"{'n/a':>9}",
                   f"{row['roofline_pct']:8.1f}%" if row["roofline_pct"] else f"{'n/a':>9}"]
        ratio = f"  {row['vs_ours']:.2f}×  {row['target']}" if row["vs_ours"] else ""
        print(f"{row['case']:<30} {row['impl']:<28} {' '.join(numbers)}{ratio}")


def _time(fn: Callable, device: str) -> float | None:
    """Median milliseconds on a GPU (``triton.testing.do_bench``), one call elsewhere (under the interpreter, a
    smoke run whose time means nothing); None when the call fails (an op this GPU or torch build lacks)."""
    try:
        fn()
        if torch.device(device).type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=10, rep=50)
        return best_seconds(fn, 1) * 1e3
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError) as error:
        print(f"    (skipped: {type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''})")
        return None


def error_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖_rms / ‖want‖_rms: the metric of fla's tests (they accept ≤ 0.005 for bf16 KDA outputs)."""
    got, want = got.double(), want.double()
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30)).item()


FLA_BF16_TOLERANCE = 0.005


def check_bf16_accuracy(work: Workload) -> float:
    """Triton forward in ``work.dtype`` vs the fp32 torch chunked path on the same (rounded) inputs at
    T = ``work.accuracy_len``; prints and returns fla's error ratio."""
    from k3course.kernels.kda_chunk import kda_chunk_triton
    from k3course.ops import kda_chunk

    T = work.accuracy_len
    inputs = kda_inputs(work, T, requires_grad=False)
    o_low, _ = kda_chunk_triton(*inputs)
    o_fp32, _ = kda_chunk(*(x.float() for x in inputs))
    ratio = error_ratio(o_low, o_fp32)
    verdict = "within" if ratio <= FLA_BF16_TOLERANCE else "OUTSIDE"
    print(f"{work.dtype} forward vs fp32 reference at T={T}: error ratio {ratio:.2e} "
          f"({verdict} fla's {FLA_BF16_TOLERANCE})")
    return ratio


def _fla(name: str):
    """fla's ``fla.ops.kda.<name>`` (chunk_kda, fused_recurrent_kda), or None when fla is not installed."""
    try:
        import fla.ops.kda as fla_kda
    except ImportError:
        return None
    return getattr(fla_kda, name, None)


def seeded(device: str, seed: int) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``; None on the meta device (which has no generator, and whose
    tensors hold no values): the input builders then give the right shapes and dtypes without allocating."""
    return None if torch.device(device).type == "meta" else torch.Generator(device=device).manual_seed(seed)


def kda_inputs(work: Workload, T: int, requires_grad: bool, batch: int = 1):
    """Seeded q, k (L2-normalised), v, g = −5·σ(·) (K3's bounded per-channel gate), β in ``work.dtype``."""
    H, D, device = work.heads, work.head_dim, work.device
    gen = seeded(device, 0)
    q = torch.randn(batch, T, H, D, device=device, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(batch, T, H, D, device=device, generator=gen), dim=-1)
    v = torch.randn(batch, T, H, D, device=device, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(batch, T, H, D, device=device, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, T, H, device=device, generator=gen))
    return [x.to(work.dtype).requires_grad_(requires_grad) for x in (q, k, v, g, beta)]


def kda_rows(work: Workload, T: int, gpu: str, backward: bool) -> list[dict]:
    """KDA chunk forward (or forward + backward) at length T: ours (Triton) vs fla's chunk_kda vs the torch
    chunked path."""
    from k3course.kernels.kda_chunk import kda_chunk_triton
    from k3course.ops import kda_chunk

    H, D, C = work.heads, work.head_dim, work.chunk
    inputs = kda_inputs(work, T, backward)
    flops = kda_forward_flops(1, T, H, D, D, C) * (3 if backward else 1)  # backward ≈ 2× the forward
    nbytes = kda_forward_bytes(1, T, H, D, D, work.dtype.itemsize) * (3 if backward else 1)

    def call(fn):
        def run():
            o, _ = fn(*inputs)
            if backward:
                o.float().sum().backward()
        return run

    fla_chunk = _fla("chunk_kda")
    contenders = [("ours (Triton)", call(kda_chunk_triton)),
                  ("fla chunk_kda" if fla_chunk else "fla chunk_kda (not installed)", fla_chunk and call(fla_chunk)),
                  ("torch chunked (k3course)", call(kda_chunk))]
    case = f"KDA {'fwd+bwd' if backward else 'forward'} T={T}"
    target = {"fla chunk_kda": "target ≥ 0.7× at T = 8192 (goal 1.0×)"}  # issue 37's
    return measure(case, contenders, flops, nbytes, gpu, work.device, target)


def decode_flops_bytes(batch: int, H: int, K: int, V: int, element: int) -> tuple[float, float]:
    """One decode step per sequence: FLOPs 2·K·V each for the decay, Sᵀk, the rank-1 update and Sᵀq (≈ 8KV per
    head); bytes: the fp32 state read and written once, plus q, k, g, v, β in and o out."""
    return batch * H * 8 * K * V, batch * H * (2 * K * V * 4 + (3 * K + 2 * V + 1) * element)


def decode_rows(work: Workload, batch: int, gpu: str) -> list[dict]:
    """One KDA decode step (T = 1) for ``batch`` sequences: ours (fused Triton, state in place) vs fla's
    fused_recurrent_kda vs the torch step. Memory-bound: the roofline is the state's bandwidth."""
    from k3course.kernels.kda_decode import kda_decode_triton
    from k3course.ops.recurrent import kda_step

    H, D = work.heads, work.head_dim
    q, k, v, g, beta = kda_inputs(work, 1, requires_grad=False, batch=batch)
    state = torch.zeros(batch, H, D, D, device=work.device, dtype=torch.float32)
    flops, nbytes = decode_flops_bytes(batch, H, D, D, work.dtype.itemsize)
    fla_decode, fla_name = _fla("fused_recurrent_kda"), "fla fused_recurrent_kda"
    contenders = [("ours (fused Triton)", lambda: kda_decode_triton(q, k, v, g, beta, state)),
                  (fla_name if fla_decode else f"{fla_name} (not installed)",
                   fla_decode and (lambda: fla_decode(q, k, v, g, beta, initial_state=state,
                                                      output_final_state=True))),
                  ("torch step (k3course)", lambda: kda_step(state.clone(), *(x[:, 0].float() for x in
                                                                               (q, k, v, g, beta))))]
    return measure(f"KDA decode batch={batch}", contenders, flops, nbytes, gpu, work.device,
                   {fla_name: "target ≥ 0.8×"})


def breakdown_rows(work: Workload, T: int, gpu: str) -> list[dict]:
    """Each of the five forward kernels alone at one length: where the forward's time goes."""
    from k3course.kernels import kda_chunk as tri

    q, k, v, g, beta = kda_inputs(work, T, requires_grad=False)
    scale, C = work.head_dim ** -0.5, work.chunk
    gc = tri.chunk_local_cumsum(g, C)
    akk, aqk = tri.intra_chunk_scores(q, k, gc, beta, scale, C)
    w, u = tri.wy_factors(k, v, gc, beta, akk, C)
    states, v_new, _ = tri.pass_states(k, gc, w, u, None, False, C)
    steps = [("1", "cumulative decay", lambda: tri.chunk_local_cumsum(g, C)),
             ("2,6", "intra-chunk scores", lambda: tri.intra_chunk_scores(q, k, gc, beta, scale, C)),
             ("3,4", "UT transform, W and U", lambda: tri.wy_factors(k, v, gc, beta, akk, C)),
             ("5,8", "state passing (sequential)", lambda: tri.pass_states(k, gc, w, u, None, False, C)),
             ("7", "output", lambda: tri.chunk_outputs(q, gc, states, v_new, aqk, scale, v.dtype, C))]
    return [row for step, name, fn in steps
            for row in measure(f"KDA fwd T={T} step {step}", [(name, fn)], None, None, gpu, work.device)]


def _routed_groups(work: Workload, experts: int, top_k: int) -> torch.Tensor:
    """End offsets of each expert's rows for uniform random top-k routing (seeded)."""
    gen = torch.Generator(device=work.device).manual_seed(1)
    scores = torch.rand(work.gemm_tokens, experts, device=work.device, generator=gen)
    expert_idx = scores.topk(top_k, dim=-1).indices
    return torch.bincount(expert_idx.reshape(-1), minlength=experts).cumsum(0).to(torch.int32)


def grouped_gemm_inputs(work: Workload, experts: int, top_k: int, requires_grad: bool = False):
    """(x [m·k, ℓ], weights [E, ℓ, n], both seeded in ``work.dtype``; the group ends [E] int32 of top-k routing)."""
    d_in, d_out = work.gemm_dims
    gen = seeded(work.device, 2)
    x = torch.randn(work.gemm_tokens * top_k, d_in, device=work.device, generator=gen).to(work.dtype)
    weights = (torch.randn(experts, d_in, d_out, device=work.device, generator=gen) * 0.02).to(work.dtype)
    return x.requires_grad_(requires_grad), weights.requires_grad_(requires_grad), _routed_groups(work, experts, top_k)


def grouped_gemm_rows(work: Workload, experts: int, top_k: int, gpu: str, backward: bool = False) -> list[dict]:
    """[rows, ℓ] @ [E, ℓ, n] for ``work.gemm_tokens`` tokens routed top-k, forward (or forward + backward: dX and
    dW, ≈ 3× the FLOPs): ours (one launch) vs ``torch._grouped_mm`` vs the per-expert loop."""
    from k3course.kernels.grouped_gemm import moe_grouped_gemm
    from k3course.moe.dispatch import grouped_mm

    x, weights, ends = grouped_gemm_inputs(work, experts, top_k, backward)
    passes = 3 if backward else 1
    flops = grouped_gemm_flops(x.shape[0], *work.gemm_dims) * passes
    nbytes = grouped_gemm_bytes(x.shape[0], *work.gemm_dims, experts, work.dtype.itemsize) * passes

    def call(fn):
        def run():
            y = fn(x, weights, ends)
            if backward:
                y.backward(torch.ones_like(y))
        return run

    peer = call(lambda *args: torch._grouped_mm(args[0], args[1], offs=args[2])) if hasattr(torch, "_grouped_mm") \
        else None
    contenders = [("ours (one launch)", call(moe_grouped_gemm)), ("torch._grouped_mm", peer),
                  ("per-expert loop", call(functools.partial(grouped_mm, impl="loop")))]
    case = f"grouped GEMM {'fwd+bwd ' if backward else ''}E={experts} top-{top_k}"
    return measure(case, contenders, flops, nbytes, gpu, work.device, {"torch._grouped_mm": "target ≥ 0.8×"})


def benchmark_rows(work: Workload, gpu: str, backward: bool = True) -> list[dict]:
    """Every row, in order: KDA forward at each length, the kernel breakdown, forward + backward, decode at each
    batch, the grouped GEMMs (forward, then forward + backward). Progress goes to a tqdm bar."""
    jobs = [functools.partial(kda_rows, work, T, gpu, False) for T in work.seq_lens]
    if work.breakdown_len:
        jobs.append(functools.partial(breakdown_rows, work, work.breakdown_len, gpu))
    if backward:
        jobs += [functools.partial(kda_rows, work, T, gpu, True) for T in work.seq_lens]
    jobs += [functools.partial(decode_rows, work, batch, gpu) for batch in work.decode_batches]
    jobs += [functools.partial(grouped_gemm_rows, work, E, top_k, gpu, grad)
             for grad in ((False, True) if backward else (False,)) for E, top_k in work.gemm_experts]
    return [row for job in tqdm(jobs, desc="benchmarks", leave=False) for row in job()]


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768], help="KDA lengths T")
    parser.add_argument("--no-backward", action="store_true", help="skip the KDA forward + backward rows")
    parser.add_argument("--scale", type=int, default=1, help="divide the GEMM widths 3584 → 3072 by this")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens routed through the grouped GEMM")
    add_options(parser, threads=0)
    args = parser.parse_args(options)
    for name in ("seq_lens", "scale", "tokens"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {values}")
    return args


def explain_cpu_skip(command: str = "k3course bench kernels", seq_lens: tuple[int, ...] = Workload.seq_lens) -> str:
    """What ``command`` would have run on a GPU, and why a CPU runs none of it."""
    lengths = "{" + ", ".join(map(str, seq_lens)) + "}"
    return (f"{command} needs a CUDA GPU: on a CPU the Triton kernels run under the interpreter, thousands of "
            "times slower than torch (see lesson 08),\nso their timings say nothing about the kernels. Skipped: "
            f"KDA chunk forward and forward + backward at B=1, T ∈ {lengths},\nH=16, K=V=128, bf16 (ours "
            "vs fla chunk_kda vs the torch chunked path); the KDA decode step (ours vs fla fused_recurrent_kda vs "
            "the torch step);\nMoE grouped GEMM at ℓ=3584 → 3072 with 64 and 128 experts, top-8 and top-16 (ours "
            "vs torch._grouped_mm vs a per-expert loop).\nCorrectness on CPU: pytest tests/test_kernels*.py.")


def main(options: list[str]) -> int:
    args = _options(options)
    settings = apply_options(args.threads, args.return_freed_memory)
    if not torch.cuda.is_available():
        print(explain_cpu_skip())
        return 0
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; roofline peaks (bf16 TFLOP/s, TB/s): {roofline_peaks_text(gpu)}; host: {settings}")
    work = Workload(seq_lens=tuple(args.seq_lens), gemm_tokens=args.tokens,
                    gemm_dims=(3584 // args.scale, 3072 // args.scale))
    check_bf16_accuracy(work)
    print_rows(benchmark_rows(work, gpu, backward=not args.no_backward))
    return 0


def roofline_peaks_text(gpu: str) -> str:
    for key, (peak, bandwidth) in PEAKS.items():
        if key in gpu:
            return f"{peak:g}, {bandwidth:g}"
    return "unknown GPU, roofline column n/a"
