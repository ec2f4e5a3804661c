"""``k3course bench moe``: the sort-based latent MoE forward vs a dense FFN of equal active FLOPs, and its stages.

Defaults: m = 4096 tokens, n = 64 experts, k = 4, d = 256, ℓ = 128, expert width 128, fp32 (``--dtype``), no grad.
The dense FFN is a GLU at width d whose hidden size gives the same active FLOPs per token as the MoE
(router + W↓ + W↑ + k experts). Times are the best over ``--rounds`` rounds of ``--repeats`` calls, the
variants taking turns (robust to other processes on a shared machine); the ratios are what to read.
``--threads 1`` avoids OpenMP spin-waits when the cores are oversubscribed, which can slow many small GEMMs
(the per-expert loop) by 10x.

Targets: MoE / dense ≤ 1.5x in fp32 and ≤ 2x in bf16. The MoE does the dense FFN's FLOPs plus routing
(top-k over n scores per token), dispatch (sort, gather, unsort) and the combine, so it cannot beat it; the
stage breakdown shows what each costs. bf16 results depend on the CPU: with AVX512-BF16 / AMX the GEMMs run
several times faster than in fp32 while routing and data movement do not, so their share grows; without bf16
GEMMs bf16 runs far slower than fp32 for both (the bench prints which CPU features it found). The per-token
loop and the NumPy rung are timed on ``--loop-tokens`` tokens and scaled, for the speed-up of chapter 01.
"""

from __future__ import annotations

import argparse

import torch

from k3course.bench import best_seconds, interleaved_best_seconds
from k3course.device import default_device
from k3course.moe import GLUFFN, LatentMoE
from k3course.moe.dispatch import sort_by_expert, unsort
from k3course.moe.latent import latent_combine, moe_flops_per_token, rms_norm
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


TARGETS = {"float32": 1.5, "bfloat16": 2.0}  # MoE / dense FFN time
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_features() -> list[str]:
    """Which of :data:`CPU_FEATURES` this CPU reports (Linux /proc/cpuinfo flags; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return []
    return [feature for feature in CPU_FEATURES if feature in flags]


def stage_calls(layer: LatentMoE, x: torch.Tensor, repeats: int) -> dict:
    """The MoE forward cut into its stages, each a call on the previous stage's outputs (for the breakdown).

    route: router GEMM, scores, top-k;  dispatch: sort by expert, gather the tokens, unsort the outputs;
    experts: the routed experts' GEMMs and activation;  projections + combine: W↓, the weighted sum over k,
    RMSNorm and W↑.
    """
    _, _, expert_idx, weights = layer.route(x)
    z = x @ layer.down_proj
    order, group_offsets = sort_by_expert(expert_idx, layer.n_routed)
    z_sorted = z.index_select(0, order // layer.top_k)
    out_sorted = layer.experts(z_sorted, group_offsets)
    slots = unsort(out_sorted, order).view(x.shape[0], layer.top_k, -1)

    def dispatch():
        unsort(out_sorted, sort_by_expert(expert_idx, layer.n_routed)[0])
        z.index_select(0, order // layer.top_k)

    def projections_and_combine():
        x @ layer.down_proj
        latent_combine(slots, layer.route_scale * weights, layer.up_proj, layer.latent_norm, layer.eps)

    return {"route": (lambda: layer.route(x), repeats), "dispatch": (dispatch, repeats),
            "experts": (lambda: layer.experts(z_sorted, group_offsets), repeats),
            "projections + combine": (projections_and_combine, repeats)}


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
        calls = {"sorted": (lambda: layer(x), args.repeats), "dense": (lambda: dense(x), args.repeats),
                 "loop": (lambda: per_token_loop(layer, x[:loop_tokens]), 1), **stage_calls(layer, x, args.repeats)}
        times = interleaved_best_seconds(calls, args.rounds, device)
    t_sorted, t_dense, t_loop = times["sorted"], times["dense"], times["loop"] * args.m / loop_tokens
    params, x_np = layer.reference_params(), x[:loop_tokens].cpu().double().numpy()
    t_numpy = best_seconds(lambda: reference.moe_forward(x_np, params, args.k), 1, device) * args.m / loop_tokens
    features = ", ".join(cpu_features()) or "none of " + ", ".join(CPU_FEATURES)
    print(f"latent MoE forward on {device.type}: m={args.m} n={args.n} k={args.k} d={args.d} "
          f"latent={args.latent} d_expert={args.d_expert}, {args.dtype}, backend={args.backend}, "
          f"{torch.get_num_threads()} CPU thread(s)")
    print(f"CPU features: {features}")
    print(f"active FLOPs per token {flops / 1e6:.3f} M; dense GLU FFN hidden {dense_hidden} has the same")
    print(f"per-token loop  {t_loop * 1e3:10.1f} ms  (timed on {loop_tokens} tokens, scaled to {args.m})")
    print(f"NumPy rung 0    {t_numpy * 1e3:10.1f} ms  (fp64 loop, timed on {loop_tokens} tokens, scaled to {args.m})")
    print(f"sort-based MoE  {t_sorted * 1e3:10.1f} ms  (max rel. difference from the loop {error:.1e})")
    for stage in ("route", "dispatch", "experts", "projections + combine"):
        print(f"  {stage:22s}{times[stage] * 1e3:8.1f} ms  ({times[stage] / t_sorted:4.0%} of the MoE)")
    print(f"dense FFN       {t_dense * 1e3:10.1f} ms")
    print(f"sort-based MoE is {t_loop / t_sorted:.0f}x faster than the per-token loop, "
          f"{t_numpy / t_sorted:.0f}x faster than the NumPy loop")
    print(f"sort-based MoE takes {t_sorted / t_dense:.2f}x the dense FFN's time "
          f"(target <= {TARGETS[args.dtype]}x in {args.dtype})")
    return 0
