"""``k3course bench moe``: the sort-based latent MoE forward vs a per-token loop and vs a dense FFN.

Defaults: m = 4096 tokens, n = 64 experts, k = 4, d = 256, ℓ = 128, expert width 128, fp32 (``--dtype``), no grad.
The dense FFN is a GLU at width d whose hidden size gives the same active FLOPs per token as the MoE
(router + W↓ + W↑ + k experts). Times are the best over ``--rounds`` rounds of ``--repeats`` calls, the
variants taking turns (robust to other processes on a shared machine); the ratios are what to read.
``--threads 1`` avoids OpenMP spin-waits when the cores are oversubscribed, which can slow many small GEMMs
(the per-expert loop) by 10x.

The two ratios are tied: the MoE does the dense FFN's FLOPs plus routing and data movement, so it cannot beat
the dense FFN, and its speed-up over the loop is at most loop / dense. On a 2-core CPU the loop costs about
0.2 ms a token (some 55 small torch calls, each paying dispatch overhead) and the dense FFN about 16 ms for
4096 tokens, which caps the speed-up near 50x: 50x over the loop means matching the dense FFN exactly.
``--dtype bfloat16`` shows the other side: on a CPU with AVX512-BF16 the GEMMs run 4x faster, the loop does not
(it is overhead), so the MoE beats the loop by >100x, but its routing and data movement, unchanged, are then
several times the dense FFN's whole time.
"""

from __future__ import annotations

import argparse

import torch

from k3course.bench import best_seconds, interleaved_best_seconds
from k3course.device import default_device
from k3course.moe import GLUFFN, LatentMoE
from k3course.moe.latent import moe_flops_per_token, rms_norm
from k3course.reference import moe as reference


def per_token_loop(layer: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """The same layer, one token and one expert at a time (the NumPy rung's loop, written in torch).

    Each token is routed, projected down, sent through its k experts, normalised and projected up on its own.
    """
    experts = layer.experts
    rows = []
    for x_t in x:
        _, _, expert_idx, weights = layer.route(x_t[None])  # [1, k]
        z_t = x_t @ layer.down_proj
        u = torch.zeros_like(z_t)
        for j, p in zip(expert_idx[0].tolist(), weights[0]):
            hidden = experts.act(z_t @ experts.gate[j], z_t @ experts.up[j])
            u = u + layer.route_scale * p * (hidden @ experts.down[j])
        rows.append(rms_norm(u, layer.latent_norm, layer.eps) @ layer.up_proj)
    return torch.stack(rows)


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench moe", description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096, help="tokens")
    parser.add_argument("--n", type=int, default=64, help="routed experts")
    parser.add_argument("--k", type=int, default=4, help="active experts per token")
    parser.add_argument("--d", type=int, default=256, help="model width")
    parser.add_argument("--latent", type=int, default=128, help="latent width ℓ")
    parser.add_argument("--d-expert", type=int, default=128, help="expert inner width")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per round (the best is reported)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each timing every variant in turn")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    parser.add_argument("--loop-tokens", type=int, default=512,
                        help="tokens the per-token loop runs on (its time is scaled to m)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and tokens")
    parser.add_argument("--backend", default="auto", choices=["auto", "loop", "torch"], help="grouped_mm backend")
    return parser.parse_args(options)


def main(options: list[str]) -> int:
    args = _options(options)
    device, dtype = default_device(), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    layer = LatentMoE(args.d, args.n, args.k, d_expert=args.d_expert, d_latent=args.latent, generator=generator,
                      backend=args.backend).to(device, dtype).eval()
    flops = moe_flops_per_token(args.d, args.n, args.k, args.d_expert, args.latent)
    dense_hidden = round(flops / (6 * args.d))
    dense = GLUFFN(args.d, dense_hidden, generator=generator).to(device, dtype).eval()
    x = torch.randn(args.m, args.d, generator=generator).to(device, dtype)
    loop_tokens = min(args.loop_tokens, args.m)
    with torch.no_grad():
        sorted_out = layer(x)
        loop_out = per_token_loop(layer, x[:loop_tokens])
        error = float((loop_out - sorted_out[:loop_tokens]).abs().max() / sorted_out.abs().max())
        times = interleaved_best_seconds({"sorted": (lambda: layer(x), args.repeats),
                                          "dense": (lambda: dense(x), args.repeats),
                                          "loop": (lambda: per_token_loop(layer, x[:loop_tokens]), 1)},
                                         args.rounds, device)
    t_sorted, t_dense, t_loop = times["sorted"], times["dense"], times["loop"] * args.m / loop_tokens
    params, x_np = layer.reference_params(), x[:loop_tokens].cpu().double().numpy()
    t_numpy = best_seconds(lambda: reference.moe_forward(x_np, params, args.k), 1, device) * args.m / loop_tokens
    print(f"latent MoE forward on {device.type}: m={args.m} n={args.n} k={args.k} d={args.d} "
          f"latent={args.latent} d_expert={args.d_expert}, {args.dtype}, backend={args.backend}, "
          f"{torch.get_num_threads()} CPU thread(s)")
    print(f"active FLOPs per token {flops / 1e6:.3f} M; dense GLU FFN hidden {dense_hidden} has the same")
    print(f"per-token loop  {t_loop * 1e3:10.1f} ms  (timed on {loop_tokens} tokens, scaled to {args.m})")
    print(f"NumPy rung 0    {t_numpy * 1e3:10.1f} ms  (fp64 loop, timed on {loop_tokens} tokens, scaled to {args.m})")
    print(f"sort-based MoE  {t_sorted * 1e3:10.1f} ms  (max rel. difference from the loop {error:.1e})")
    print(f"dense FFN       {t_dense * 1e3:10.1f} ms")
    print(f"sort-based MoE is {t_loop / t_sorted:.0f}x faster than the per-token loop (target >= 50x), "
          f"{t_numpy / t_sorted:.0f}x faster than the NumPy loop")
    print(f"sort-based MoE takes {t_sorted / t_dense:.2f}x the dense FFN's time (target <= 2x)")
    return 0
