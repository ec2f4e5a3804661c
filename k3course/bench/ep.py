"""``k3course bench ep``: the expert-parallel latent MoE on P processes vs raw all-to-alls and vs one process.

For each P in ``--ranks`` a P-rank group (gloo CPU processes, ``--threads`` threads each, default 1;
``--backend nccl``: one GPU per rank) runs the layer's forward on m / P tokens per rank (no grad) and times,
best of ``--repeats``:

    layer       the whole expert-parallel forward (slowest rank, after a barrier)
    exchange    the part of it spent in the layer's exchanges: split sizes, packing, dispatch, combine
    raw         two bare ``all_to_all_single`` calls with the same split sizes and row width (dispatch, combine)

achieved bandwidth = bytes that crossed between ranks (dispatch + combine payload) / time, summed over the
ranks; the layer-to-raw ratio is what the layer's bookkeeping costs. The one-process time is the plain layer
on all m tokens in this process (with as many threads). On one CPU the P processes share the cores, so P ranks are
not P times faster here: the ratios, measured in one run, are what to read.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from k3course.bench import add_options, apply_options
from k3course.device import best_seconds
from k3course.distributed import exchange_counts, parallelize_experts, run_ranks, split_sizes
from k3course.moe import LatentMoE, MoE


def _layer(opts: argparse.Namespace) -> MoE:
    generator = torch.Generator().manual_seed(0)
    if opts.latent:
        return LatentMoE(opts.d, opts.n, opts.k, expert_dim=opts.expert_dim, latent_dim=opts.latent,
                         generator=generator).eval()
    return MoE(opts.d, opts.n, opts.k, expert_dim=opts.expert_dim, generator=generator).eval()


def _tokens(opts: argparse.Namespace) -> torch.Tensor:
    return torch.randn(opts.m, opts.d, generator=torch.Generator().manual_seed(1))


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Best of ``repeats`` calls of fn, each started after a barrier (so the ranks start together)."""
    def call():
        dist.barrier()
        fn()
    return best_seconds(call, repeats, device)


def rank_timings(rank: int, world_size: int, opts: argparse.Namespace) -> dict:
    """On one rank: best layer, exchange and raw all-to-all seconds, and the payload bytes moved between ranks."""
    apply_options(opts.threads, opts.return_freed_memory)  # in this rank's process too
    device = torch.device("cuda", rank) if opts.backend == "nccl" else torch.device("cpu")
    layer = parallelize_experts(_layer(opts), dedup=opts.dedup).to(device)
    dispatcher = layer.dispatcher
    dispatcher.time_exchanges = True
    x = _tokens(opts).chunk(world_size)[rank].to(device)
    exchange = []
    with torch.no_grad():
        def forward():
            layer(x)
            exchange.append(dispatcher.last_exchange_seconds)
        layer_seconds = _timed(forward, device, opts.repeats)
        _, _, expert_idx, _ = layer.route(x)
    payload = dispatcher.last_traffic["dispatch"] + dispatcher.last_traffic["combine"]
    send = split_sizes(expert_idx, opts.n, world_size)
    recv = exchange_counts(send, [1] * world_size, [1] * world_size).tolist()
    send = send.tolist()
    width = opts.latent or opts.d
    sent, received = torch.randn(sum(send), width, device=device), torch.empty(sum(recv), width, device=device)

    def raw():
        dist.all_to_all_single(received, sent, recv, send)
        dist.all_to_all_single(sent, received, send, recv)
    raw_seconds = _timed(raw, device, opts.repeats)
    return {"layer": layer_seconds, "exchange": min(exchange), "raw": raw_seconds, "bytes": payload}


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench ep", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes P to run")
    parser.add_argument("--m", type=int, default=4096, help="tokens in all (m / P per rank)")
    parser.add_argument("--n", type=int, default=32, help="routed experts")
    parser.add_argument("--k", type=int, default=4, help="active experts per token")
    parser.add_argument("--d", type=int, default=256, help="model width")
    parser.add_argument("--latent", type=int, default=128, help="latent width ℓ (0: a full-width MoE)")
    parser.add_argument("--expert-dim", type=int, default=128, help="expert inner width")
    parser.add_argument("--dedup", action="store_true", help="send each token once per destination rank")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="process-group backend")
    add_options(parser, threads=1, repeats=5)
    return parser.parse_args(options)


def main(options: list[str]) -> int:
    args = _options(options)
    settings = apply_options(args.threads, args.return_freed_memory)
    device = torch.device("cuda") if args.backend == "nccl" else torch.device("cpu")
    layer, x = _layer(args).to(device), _tokens(args).to(device)
    with torch.no_grad():
        one_process = best_seconds(lambda: layer(x), args.repeats, device)
    kind = f"latent MoE (ℓ = {args.latent})" if args.latent else "MoE (full width)"
    print(f"expert-parallel {kind} forward on {args.backend}: m={args.m} n={args.n} k={args.k} d={args.d} "
          f"expert_dim={args.expert_dim}, fp32, dedup={args.dedup}; per process: {settings}")
    print(f"one process, all {args.m} tokens: {one_process * 1e3:.2f} ms")
    for world_size in args.ranks:
        ranks = run_ranks(rank_timings, world_size, args, timeout_s=600, backend=args.backend)
        moved = sum(r["bytes"] for r in ranks)
        slowest = {key: max(r[key] for r in ranks) for key in ("layer", "exchange", "raw")}
        layer_bw, raw_bw = moved / slowest["exchange"], moved / slowest["raw"]
        print(f"P={world_size}: layer {slowest['layer'] * 1e3:.2f} ms ({one_process / slowest['layer']:.2f}x one "
              f"process); {moved / 1e6:.2f} MB between ranks; exchange {slowest['exchange'] * 1e3:.2f} ms = "
              f"{layer_bw / 1e9:.3f} GB/s, raw all_to_all_single {slowest['raw'] * 1e3:.2f} ms = "
              f"{raw_bw / 1e9:.3f} GB/s (layer achieves {layer_bw / raw_bw:.2f}x raw)")
    return 0
