"""``k3course bench kda``: chunked vs recurrent KDA on this machine (fp32, B=1, H=4, K=V=64 by default).

Reports, from one run (the chunked lengths and the recurrent rung take turns over ``--rounds`` rounds, so that
a busy spell of a shared machine slows all of them alike): the recurrent / chunked time ratio at T = 4096
(target ≥ 10×), the chunked time growth from T = 1024 to 8192 (target ≤ 10× for 8× the length: linear in T),
and the chunked path's achieved GFLOP/s (from the FLOP formula of DESIGN §6) as a fraction of this machine's
measured fp32 matmul GFLOP/s.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from k3course.attention.chunk import kda_chunk
from k3course.attention.recurrent import kda_recurrent
from k3course.bench import best_seconds, interleaved_best_seconds


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


def kda_inputs(T: int, heads: int = 4, dim: int = 64, seed: int = 0):
    """Seeded q, k (unit norm), v, g ∈ (−1, 0), beta for one sequence: ``[1, T, heads, dim]``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, heads, dim, generator=gen)
    k = F.normalize(torch.randn(1, T, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, T, heads, dim, generator=gen)
    g = -torch.rand(1, T, heads, dim, generator=gen)
    return q, k, v, g, torch.rand(1, T, heads, generator=gen)


def main(options: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k3course bench kda", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--recurrent-length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="calls per round; each time is the best call")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each timing every variant in turn")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(options)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths, T_rec = sorted(set(args.lengths) | {args.recurrent_length}), args.recurrent_length
    inputs = {T: kda_inputs(T, args.heads, args.dim) for T in lengths}
    calls = {T: (lambda T=T: kda_chunk(*inputs[T], chunk_size=args.chunk_size), args.repeats) for T in lengths}
    calls["recurrent"] = (lambda: kda_recurrent(*inputs[T_rec]), args.repeats)
    with torch.no_grad():
        peak = matmul_gflops()
        chunked = interleaved_best_seconds(calls, args.rounds)
    recurrent = chunked.pop("recurrent")
    print(f"fp32 matmul (1024²): {peak:.1f} GFLOP/s, {torch.get_num_threads()} threads; chunk size {args.chunk_size}; "
          f"best of {args.rounds} rounds x {args.repeats} calls")
    for T in lengths:
        achieved = args.heads * chunk_flops(T, args.dim, args.chunk_size) / chunked[T] / 1e9
        print(f"chunked   T={T:>6}: {chunked[T] * 1e3:9.1f} ms  {achieved:6.2f} GFLOP/s "
              f"= {achieved / peak:.1%} of matmul")
    print(f"recurrent T={T_rec:>6}: {recurrent * 1e3:9.1f} ms")
    print(f"recurrent / chunked at T={T_rec}: {recurrent / chunked[T_rec]:.1f}x  (target >= 10x)")
    short, long = min(args.lengths), max(args.lengths)
    growth = chunked[long] / chunked[short]
    print(f"chunked time growth T={short} -> {long} ({long // short}x longer): {growth:.1f}x (target <= 10x, 8x)")
    return 0
