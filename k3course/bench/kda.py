"""``k3course bench kda``: chunked vs recurrent KDA on this machine (fp32, B=1, H=4, K=V=64 by default).

The workload is the K3 layer's gate: g = −5·σ(z) per channel (``kda_gate`` with z ~ N(0, 1)), down to the lower
bound, so a 64-token chunk decays by up to ~320; mild gates g ~ −U(0, 1) are a second row. Reports, from one
run (every variant takes turns over ``--rounds`` rounds, so that a busy spell of a shared machine slows all of
them alike): fla's naive recurrent reference (when fla is installed) and the package's recurrent path against
the chunked one at T = 4096 (target ≥ 10× each), the chunked time growth from T = 1024 to 8192 (target ≤ 9× for
8× the length: linear in T), and the chunked path's GFLOP/s as a fraction of this machine's measured fp32
matmul rate (target ≥ 20%), FLOPs counted by :func:`chunk_flops`.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.nn.functional as F

from k3course.attention.chunk import kda_chunk
from k3course.attention.kda import kda_gate
from k3course.attention.recurrent import kda_recurrent
from k3course.bench import best_seconds, interleaved_best_seconds

GATES = ("layer", "mild")


def chunk_flops(T: int, d: int, chunk_size: int) -> float:
    """FLOPs of chunkwise KDA for one head (DESIGN §6): ≈ 6T·d² + 3T·C·d + T·C²."""
    return 6 * T * d * d + 3 * T * chunk_size * d + T * chunk_size * chunk_size


def attention_flops(T: int, d: int) -> float:
    """FLOPs of causal softmax attention for one head, counted as 2T²·d (DESIGN §6)."""
    return 2 * T * T * d


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate, GFLOP/s, from an n×n by n×n product."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / best_seconds(lambda: a @ b, repeats) / 1e9


def kda_inputs(T: int, heads: int = 4, dim: int = 64, seed: int = 0, gates: str = "layer"):
    """Seeded q, k (unit norm), v, g, beta for one sequence: ``[1, T, heads, dim]``.

    gates ``"layer"``: the K3 layer's gate −5·σ(z) (A_log = 0, dt_bias = 0, z ~ N(0, 1)); ``"mild"``: −U(0, 1)."""
    if gates not in GATES:
        raise ValueError(f"gates must be one of {GATES}, got {gates!r}")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, heads, dim, generator=gen)
    k = F.normalize(torch.randn(1, T, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, T, heads, dim, generator=gen)
    z = torch.randn(1, T, heads, dim, generator=gen)
    if gates == "layer":
        g = kda_gate(z, torch.zeros(heads), torch.zeros(heads, dim))
    else:
        g = -torch.rand(z.shape, generator=gen)
    return q, k, v, g, torch.rand(1, T, heads, generator=gen)


def fla_naive_recurrent():
    """fla's naive recurrent KDA reference (the ``oracle`` extra), or None when fla is not installed."""
    if importlib.util.find_spec("fla") is None:
        return None
    from fla.ops.kda.naive import naive_recurrent_kda

    return naive_recurrent_kda


def main(options: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k3course bench kda", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--recurrent-length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="chunked calls per round; each time is the best call")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each timing every variant in turn")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(options)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths, T_rec = sorted(set(args.lengths) | {args.recurrent_length}), args.recurrent_length
    inputs = {T: kda_inputs(T, args.heads, args.dim) for T in lengths}
    mild = kda_inputs(T_rec, args.heads, args.dim, gates="mild")
    calls = {T: (lambda T=T: kda_chunk(*inputs[T], chunk_size=args.chunk_size), args.repeats) for T in lengths}
    calls["mild"] = (lambda: kda_chunk(*mild, chunk_size=args.chunk_size), args.repeats)
    calls["recurrent"] = (lambda: kda_recurrent(*inputs[T_rec]), 1)
    naive = fla_naive_recurrent()
    if naive is not None:
        calls["fla naive"] = (lambda: naive(*inputs[T_rec]), 1)
    with torch.no_grad():
        peak = matmul_gflops()
        times = interleaved_best_seconds(calls, args.rounds)
    print(f"fp32 matmul (1024²): {peak:.1f} GFLOP/s, {torch.get_num_threads()} threads; chunk size {args.chunk_size}; "
          f"best of {args.rounds} rounds; FLOPs per head 6T·d² + 3T·C·d + T·C² (d = {args.dim}, C = {args.chunk_size})")
    rows = [(f"chunked   T={T:>6} (layer gates)", T, times[T]) for T in lengths]
    rows.append((f"chunked   T={T_rec:>6} (mild gates) ", T_rec, times["mild"]))
    for label, T, seconds in rows:
        achieved = args.heads * chunk_flops(T, args.dim, args.chunk_size) / seconds / 1e9
        print(f"{label}: {seconds * 1e3:9.1f} ms  {achieved:6.2f} GFLOP/s = {achieved / peak:.1%} of matmul "
              "(target >= 20%)")
    chunked = times[T_rec]
    for name in ("recurrent", "fla naive"):
        if name in times:
            print(f"{name:<9} T={T_rec:>6}: {times[name] * 1e3:9.1f} ms  = {times[name] / chunked:.1f}x the chunked "
                  "path (target >= 10x)")
    short, long = min(args.lengths), max(args.lengths)
    growth = times[long] / times[short]
    print(f"chunked time growth T={short} -> {long} ({long // short}x longer): {growth:.1f}x (target <= 9x)")
    return 0
