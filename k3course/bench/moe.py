"""``k3course bench moe``: the sort-based latent MoE vs a dense FFN of equal active FLOPs, forward and training.

The workload is K3's MoE at a CPU-sized width: latent experts (ℓ = d/2), sigmoid router, top-k on s + b,
route scale 1, SiTU-GLU experts (K3's activation: two tanh per hidden unit, a large share of the time on a
CPU); defaults m = 4096 tokens, n = 64 experts, k = 4, d = 256, ℓ = 128, expert width 128, fp32 (``--dtype``).
Tokens are N(0, 1) rows (unit RMS, like the RMSNorm'd stream the layer reads); the random router then spreads
them about evenly, as quantile balancing does in training (the bench prints the load's max-violation).
Shared experts are left out of both sides: they are a dense FFN either way and would only dilute the ratio.

The dense FFN is a GLU at width d with the same activation and the largest hidden size that is a multiple
of 16 without exceeding the MoE's active FLOPs (router + W↓ + W↑ + k experts); a hidden size like 363 would
make its GEMMs slower and flatter the MoE. Two rows are timed for each: the forward (eval, no grad) and a
training step (forward in training mode, backward of a fixed output gradient into the weights and the input,
and, for the MoE, the quantile bias update, which a training loop runs once per optimizer step).

Both are broken down by stage from the layer's own profiler ranges (``MoE.forward``: route, down projection,
dispatch, experts, combine; :func:`~k3course.bench.range_seconds`): the real layer runs ``--repeats`` times under
``torch.profiler`` and each stage is the mean time of its range, in training plus the backward of the autograd
nodes made inside it, plus the bias update. Every range the layer opens gets a row, so the breakdown follows the
layer when it changes; what runs outside the ranges is its own row, and the GEMMs' share is printed too.

Times are the best over ``--rounds`` rounds of ``--repeats`` calls, the variants taking turns (robust to
other processes on a shared machine); the ratios are what to read. ``--threads`` defaults to 1: with more
threads than free cores, OpenMP barriers in the per-expert loop's many small ops can cost more than the work.

Targets: MoE / dense ≤ 1.5x in fp32 and ≤ 2x in bf16. The MoE does the dense FFN's FLOPs plus routing
(top-k over n scores per token), dispatch (sort, gather, unsort) and the combine, in GEMMs of m·k/n rows
instead of m, so it cannot beat it; the stage breakdown shows what each costs. bf16 results depend on the CPU:
the bench times one bf16 and one fp32 GEMM of the dense FFN's shape and prints the ratio. With AVX512-BF16 /
AMX, bf16 GEMMs run several times faster than fp32 while routing and data movement do not, so their share
grows; without bf16 GEMMs a bf16 GEMM takes a slow software path, for the MoE and the dense FFN alike. The
per-token loop and the NumPy rung are timed on ``--loop-tokens`` tokens and scaled, for the speed-up of chapter 01.

Freed memory is kept in the process, as ``k3course train`` keeps it (:func:`~k3course.device.keep_freed_memory`),
and page faults per call are printed for both sides. ``--return-freed-memory`` leaves glibc's default, which hands
large freed blocks back to the OS: the dense FFN's temporaries are m × hidden (megabytes), the MoE's per-expert
blocks small, so the dense side then pays more page faults.
"""

from __future__ import annotations

import argparse

import torch

from k3course.bench import (
    add_options,
    apply_options,
    op_seconds,
    page_faults_per_call,
    profile_calls,
    range_seconds,
)
from k3course.debug import profiler_range
from k3course.device import best_seconds, default_device, interleaved_best_seconds
from k3course.moe import GLUFFN, LatentMoE
from k3course.moe.balancing import expert_load
from k3course.moe.latent import moe_flops_per_token, rms_norm
from k3course.moe.stats import max_violation
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
    parser.add_argument("--expert-dim", type=int, default=128, help="expert inner width")
    parser.add_argument("--activation", default="situ_glu", choices=["situ_glu", "swiglu"],
                        help="expert activation (K3: situ_glu), the same in the dense FFN")
    parser.add_argument("--loop-tokens", type=int, default=256,
                        help="tokens the per-token loop runs on (its time is scaled to m)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and tokens")
    parser.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch", "loop"],
                        help="the kernel backend: how the experts' grouped GEMM runs (k3course.kernels.BACKENDS)")
    add_options(parser, threads=1, repeats=3, rounds=5)
    args = parser.parse_args(options)
    for name in ("m", "n", "k", "d", "latent", "expert_dim", "loop_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


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


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown CPU" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                        "unknown CPU")
    except OSError:
        return "unknown CPU"


def gemm_rates(m: int, d: int, hidden: int, device: torch.device) -> dict[str, float]:
    """FLOP/s of one [m, d] @ [d, hidden] GEMM in fp32 and in bf16, best of 3 each, measured now."""
    a, b = torch.randn(m, d, device=device), torch.randn(d, hidden, device=device)
    low_a, low_b = a.bfloat16(), b.bfloat16()
    flops = 2 * m * d * hidden
    return {"float32": flops / best_seconds(lambda: a @ b, 3, device),
            "bfloat16": flops / best_seconds(lambda: low_a @ low_b, 3, device)}


def dense_hidden_size(flops: int, d: int) -> int:
    """The largest multiple of 16 whose GLU FFN (6·d·hidden FLOPs per token) does not exceed ``flops``."""
    return max(16, 16 * (flops // (6 * d * 16)))


def training_step(module: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    """A call that runs module(x) in training mode, backpropagates grad_out into its weights and x, and
    applies the MoE's bias update (a training loop runs it once per optimizer step, here in the profiler range
    moe.bias update); gradients are dropped."""
    x = x.detach().requires_grad_()

    def step():
        module(x).backward(grad_out)
        if isinstance(module, LatentMoE):
            with profiler_range("moe.bias update"):
                module.update_bias()
        module.zero_grad(set_to_none=True)
        x.grad = None
    return step


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm")  # the profiler's names of the GEMMs


def stage_seconds(fn, calls: int, device: torch.device | None = None) -> tuple[dict, float, float]:
    """Where a call of ``fn`` (the MoE's forward or training step) spends its time, from the layer's profiler
    ranges: ({stage: seconds per call}, seconds per profiled call, seconds in GEMMs per call), the mean of
    ``calls`` calls under ``torch.profiler`` (:func:`~k3course.bench.range_seconds`)."""
    events, profiled = profile_calls(fn, calls, device)
    return range_seconds(events, "moe.", calls, device), profiled, op_seconds(events, GEMM_OPS, calls, device)


def _stage_lines(stages: dict, profiled: float, gemms: float, of_what: str) -> list[str]:
    """One row per stage (ms and share of the profiled call), then what ran outside the ranges, then the GEMMs."""
    rows = {**stages, "outside the ranges": profiled - sum(stages.values()), "GEMMs (within the above)": gemms}
    return [f"  {stage:26s}{seconds * 1e3:8.1f} ms  ({seconds / profiled:4.0%} of {of_what})"
            for stage, seconds in rows.items()]


def _build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(MoE layer, dense FFN, tokens x [m, d], output gradient [m, d], dense hidden size)."""
    generator = torch.Generator().manual_seed(0)
    layer = LatentMoE(args.d, args.n, args.k, expert_dim=args.expert_dim, latent_dim=args.latent,
                      activation=args.activation, balancing="quantile", generator=generator,
                      kernels=args.kernels).to(device, dtype)
    flops = moe_flops_per_token(args.d, args.n, args.k, args.expert_dim, args.latent)
    hidden = dense_hidden_size(flops, args.d)
    dense = GLUFFN(args.d, hidden, args.activation, generator=generator).to(device, dtype)
    x = torch.randn(args.m, args.d, generator=generator).to(device, dtype)
    grad_out = torch.randn(args.m, args.d, generator=generator).to(device, dtype)
    return layer, dense, x, grad_out, hidden


def _print_machine(args: argparse.Namespace, device: torch.device, hidden: int) -> None:
    """Which CPU, its bf16 features, and how fast a bf16 GEMM runs next to an fp32 one on it, now."""
    features = cpu_features()
    rates = gemm_rates(min(args.m, 1024), args.d, hidden, device)
    slowdown = rates["float32"] / rates["bfloat16"]
    print(f"CPU: {cpu_name()}; features: {', '.join(features) or 'none of ' + ', '.join(CPU_FEATURES)}")
    print(f"GEMM [{min(args.m, 1024)}x{args.d}]@[{args.d}x{hidden}]: fp32 {rates['float32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {rates['bfloat16'] / 1e9:.1f} GFLOP/s ({slowdown:.1f}x the fp32 time)")
    if device.type == "cpu" and not {"avx512_bf16", "amx_bf16"} & set(features):
        print(f"this CPU has no bf16 GEMMs (no avx512_bf16 / amx_bf16): bf16 matmuls take a software path "
              f"{slowdown:.0f}x slower than fp32, in the MoE and the dense FFN alike: a bf16 run compares two "
              f"emulated layers, not what bf16 hardware would show")


def _faults_line(faults: dict, train_faults: dict) -> str:
    """Page faults per call of each side, forward and training step."""
    if None in faults.values() or None in train_faults.values():
        return "page faults: not counted on this platform"
    return (f"page faults per call: forward MoE {faults['sorted']:.0f}, dense {faults['dense']:.0f}; training step "
            f"MoE {train_faults['sorted']:.0f}, dense {train_faults['dense']:.0f}")


def main(options: list[str]) -> int:
    args = _options(options)
    settings = apply_options(args.threads, args.return_freed_memory)
    device, dtype = default_device(), getattr(torch, args.dtype)
    layer, dense, x, grad_out, hidden = _build(args, device, dtype)
    loop_tokens = min(args.loop_tokens, args.m)
    with torch.no_grad():
        layer.eval()
        sorted_out = layer(x)
        loop_out = per_token_loop(layer, x[:loop_tokens])
        error = float((loop_out - sorted_out[:loop_tokens]).abs().max() / sorted_out.abs().max())
        violation = max_violation(expert_load(layer.route(x)[2], args.n))
        calls = {"sorted": (lambda: layer(x), args.repeats), "dense": (lambda: dense(x), args.repeats),
                 "loop": (lambda: per_token_loop(layer, x[:loop_tokens]), 1)}
        times = interleaved_best_seconds(calls, args.rounds, device)
        faults = {name: page_faults_per_call(calls[name][0]) for name in ("sorted", "dense")}
        stages = stage_seconds(lambda: layer(x), args.repeats, device)
    layer.train(), dense.train()
    train_calls = {"sorted": (training_step(layer, x, grad_out), args.repeats),
                   "dense": (training_step(dense, x, grad_out), args.repeats)}
    train_times = interleaved_best_seconds(train_calls, args.rounds, device)
    train_faults = {name: page_faults_per_call(train_calls[name][0]) for name in ("sorted", "dense")}
    train_stages = stage_seconds(train_calls["sorted"][0], args.repeats, device)
    t_sorted, t_dense, t_loop = times["sorted"], times["dense"], times["loop"] * args.m / loop_tokens
    params, x_np = layer.reference_params(), x[:loop_tokens].cpu().double().numpy()
    t_numpy = best_seconds(lambda: reference.moe_forward(x_np, params, args.k), 1, device) * args.m / loop_tokens
    flops = moe_flops_per_token(args.d, args.n, args.k, args.expert_dim, args.latent)

    print(f"latent MoE on {device.type}: m={args.m} n={args.n} k={args.k} d={args.d} latent={args.latent} "
          f"expert_dim={args.expert_dim} {args.activation}, {args.dtype}, kernels={args.kernels}, "
          f"{torch.get_num_threads()} CPU thread(s)")
    print(f"settings: {settings}")
    _print_machine(args, device, hidden)
    print(f"active FLOPs per token: MoE {flops / 1e6:.3f} M; dense GLU FFN hidden {hidden}: "
          f"{6 * args.d * hidden / 1e6:.3f} M ({6 * args.d * hidden / flops:.1%} of the MoE's)")
    print(f"routing: {args.m * args.k / args.n:.0f} rows per expert on average, max-violation "
          f"{violation:.2f} (busiest expert / mean load - 1)")
    print(f"per-token loop  {t_loop * 1e3:10.1f} ms  (timed on {loop_tokens} tokens, scaled to {args.m})")
    print(f"NumPy rung 0    {t_numpy * 1e3:10.1f} ms  (fp64 loop, timed on {loop_tokens} tokens, scaled to {args.m})")
    print(f"sort-based MoE  {t_sorted * 1e3:10.1f} ms  forward (max rel. difference from the loop {error:.1e})")
    print(f"  by the layer's profiler ranges, mean of {args.repeats} profiled calls ({stages[1] * 1e3:.1f} ms each):")
    print("\n".join(_stage_lines(*stages, "the MoE")))
    print(f"dense FFN       {t_dense * 1e3:10.1f} ms  forward")
    print(f"training step: sort-based MoE {train_times['sorted'] * 1e3:.1f} ms, dense FFN "
          f"{train_times['dense'] * 1e3:.1f} ms  (forward + backward + bias update)")
    print(f"  by the layer's profiler ranges, forward + backward of each, mean of {args.repeats} profiled steps "
          f"({train_stages[1] * 1e3:.1f} ms each):")
    print("\n".join(_stage_lines(*train_stages, "the MoE's step")))
    print(f"sort-based MoE is {t_loop / t_sorted:.0f}x faster than the per-token loop, "
          f"{t_numpy / t_sorted:.0f}x faster than the NumPy loop")
    print(_faults_line(faults, train_faults))
    target = TARGETS[args.dtype]
    ratios = {"forward": t_sorted / t_dense, "training step": train_times["sorted"] / train_times["dense"]}
    for row, ratio in ratios.items():
        verdict = "met" if ratio <= target else "NOT met"
        print(f"{row}: sort-based MoE takes {ratio:.2f}x the dense FFN's time "
              f"(target <= {target}x in {args.dtype}: {verdict})")
    return 0
