"""``k3course bench decode``: time per output token (TPOT) and decoding memory vs context, MLA vs hybrid vs KDA.

One model size (the ``tiny`` preset by default: 4 layers, d = 128), three attention schedules with the same
weights' shapes: all-MLA (``kda_per_mla=0``), the 3:1 hybrid (the preset's schedule: 1 MLA layer in 4) and
all-KDA (``mla_layers=()``). For each batch size B and context L, every schedule's cache is filled to L tokens,
then N one-token decode steps run, the three schedules taking turns step by step (a busy spell of the shared
machine slows all of them alike). Reported per (B, L, schedule): the best and median TPOT over the N steps,
the bytes the cache holds (``K3Cache.nbytes()``, summed from the tensors) and the accounting's prediction
``B · accounting.kv_cache_bytes(cfg, L, dtype_bytes=4)`` (fp32 activations on the CPU, so dtype_bytes = 4; the KDA
state is fp32 in any case). The two must be equal.

Filling the cache: ``--fill random`` (default) writes L random latent / rope-key rows into each MLA cache and a
random state into each KDA cache, without running the model; the cost of a decode step depends on how much
the cache holds, not on its values, and a real prefill of 64k tokens takes far longer (the MLA prefill is
quadratic in L). ``--fill prefill`` runs the real prefill, in chunks of ``--chunk`` tokens through
the cache under ``torch.no_grad`` (use it with short contexts; the test checks both fills hold the same bytes).

The slope of the median TPOT against L (least squares, µs per 1k context tokens) is the per-token cost of
reading the cache: all-MLA reads L · (kv_lora_rank + rope) numbers per MLA layer per step, the hybrid a quarter
of that, all-KDA a constant H·K·V state per layer. ``--save`` writes ``k3course/results/decode_bench.json`` and
``decode_bench.png``, which notebook 14 reads. Decoding runs on one thread by default (``--threads``): on a
shared machine OpenMP spin-waits otherwise make single-token steps vary widely. Freed memory is kept in the
process, as in ``k3course train`` (``--return-freed-memory``: glibc's default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from k3course import accounting
from k3course.bench import add_options, apply_options
from k3course.config import K3Config
from k3course.layers.kda import KDACache
from k3course.model import K3Cache, K3Model

RESULTS = Path(__file__).resolve().parent.parent / "results"
DTYPE_BYTES = 4  # fp32 activations on the CPU
SCHEDULES = ("all-MLA", "hybrid 3:1", "all-KDA")


def extrapolate_tpot(contexts: list[int], seconds: list[float], target: int) -> float:
    """TPOT at ``target`` tokens from the least-squares line t(L) = t̄ + slope·(L − L̄) through measured points."""
    mean_l, mean_t = statistics.fmean(contexts), statistics.fmean(seconds)
    slope = slope_us_per_1k(contexts, seconds) * 1e-9
    return mean_t + slope * (target - mean_l)


def schedule_configs(cfg: K3Config) -> dict[str, K3Config]:
    """The three schedules of one model size: all-MLA (r = 0), the config's hybrid, all-KDA (no MLA layer)."""
    return {"all-MLA": cfg.replace(kda_per_mla=0, mla_layers=None), "hybrid 3:1": cfg,
            "all-KDA": cfg.replace(mla_layers=())}


def fill_random(cache: K3Cache, context: int, generator: torch.Generator) -> None:
    """Make ``cache`` hold ``context`` tokens without running the model.

    MLA caches get ``context`` random rows ``[B, context, kv_lora_rank]`` and ``[B, context, rope]`` appended;
    KDA caches a random state ``[B, H, K, V]`` (scaled to stay small) and ``length = context``.
    """
    for layer in cache.layers:
        if isinstance(layer, KDACache):
            layer.state.copy_(0.1 * torch.randn(layer.state.shape, generator=generator).to(layer.state.device))
            layer.length = context
        else:
            shape, device = (layer.batch_size, context), layer.latent.device
            layer.append(torch.randn(*shape, layer.latent.shape[-1], generator=generator).to(device),
                         torch.randn(*shape, layer.rope_key.shape[-1], generator=generator).to(device))


def fill_prefill(model: K3Model, cache: K3Cache, context: int, chunk: int, generator: torch.Generator) -> None:
    """Make ``cache`` hold ``context`` tokens by running the model on random tokens, ``chunk`` tokens a call."""
    vocab = model.cfg.vocab_size
    for start in range(0, context, chunk):
        size = min(chunk, context - start)
        tokens = torch.randint(0, vocab, (cache.batch_size, size), generator=generator)
        model(tokens.to(model.embed.weight.device), cache)


def measure_point(models: dict[str, K3Model], batch: int, context: int, steps: int, fill: str = "random",
                  chunk: int = 1024, seed: int = 0) -> dict[str, dict]:
    """Fill each schedule's cache to ``context`` tokens for ``batch`` sequences, then time ``steps`` decode steps,
    the schedules taking turns. Returns schedule -> {tpot_best_s, tpot_median_s, measured_bytes, predicted_bytes}.

    Bytes are taken at ``context`` tokens, before decoding; ``predicted_bytes = batch · kv_cache_bytes(context, 4)``.
    """
    if fill not in ("random", "prefill"):
        raise ValueError(f"fill must be 'random' or 'prefill', got {fill!r}")
    generator = torch.Generator().manual_seed(seed)
    caches, rows = {}, {}
    for name, model in models.items():
        cache = model.new_cache(batch, context + steps)
        if fill == "random":
            fill_random(cache, context, generator)
        else:
            fill_prefill(model, cache, context, chunk, generator)
        caches[name] = cache
        rows[name] = {"measured_bytes": cache.nbytes(),
                      "predicted_bytes": batch * accounting.kv_cache_bytes(model.cfg, context, DTYPE_BYTES)}
    times = _interleaved_decode(models, caches, steps, generator)
    for name, seconds in times.items():
        rows[name].update(tpot_best_s=min(seconds), tpot_median_s=statistics.median(seconds))
    return rows


def _interleaved_decode(models, caches, steps: int, generator) -> dict[str, list[float]]:
    """Seconds of each one-token decode step ``model(token [B, 1], cache)``, schedules taking turns each step."""
    times = {name: [] for name in models}
    for _ in range(steps):
        for name, model in models.items():
            token = torch.randint(0, model.cfg.vocab_size, (caches[name].batch_size, 1), generator=generator)
            token = token.to(model.embed.weight.device)
            _synchronize(token.device)
            start = time.perf_counter()
            model(token, caches[name])
            _synchronize(token.device)
            times[name].append(time.perf_counter() - start)
    return times


def _synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a step's time covers its kernels (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slope_us_per_1k(contexts: list[int], seconds: list[float]) -> float:
    """Least-squares slope of TPOT against context: Σ(L − L̄)(t − t̄) / Σ(L − L̄)², in µs per 1000 tokens."""
    mean_l, mean_t = statistics.fmean(contexts), statistics.fmean(seconds)
    num = sum((l - mean_l) * (t - mean_t) for l, t in zip(contexts, seconds))
    den = sum((l - mean_l) ** 2 for l in contexts)
    return num / den * 1e9


def run(cfg: K3Config, contexts: list[int], batches: list[int], steps: int, fill: str = "random",
        chunk: int = 1024, device: str = "cpu") -> dict:
    """The whole benchmark: every (batch, context, schedule) point, and per batch the TPOT slopes and ratios.

    On CUDA the KDA layers decode with the Triton decode kernel and MLA in the absorbed form (the layers' own
    path choice); on CPU the torch recurrent step."""
    torch.manual_seed(0)
    models = {name: K3Model.from_config(c, device=device).eval() for name, c in schedule_configs(cfg).items()}
    points = []
    with torch.no_grad():
        for batch in batches:
            for context in contexts:
                for name, row in measure_point(models, batch, context, steps, fill, chunk).items():
                    points.append({"batch": batch, "context": context, "schedule": name, **row})
    return {"preset": cfg.name, "layers": {n: list(c.layer_types()) for n, c in schedule_configs(cfg).items()},
            "dtype_bytes": DTYPE_BYTES, "steps": steps, "fill": fill, "threads": torch.get_num_threads(),
            "device": str(device),
            "points": points, "slopes": _slopes(points, batches, contexts)}


def _slopes(points: list[dict], batches: list[int], contexts: list[int]) -> dict:
    """Per batch: slope of the median and of the best TPOT (µs per 1k tokens) per schedule, and over all-MLA's."""
    out = {}
    for batch in batches:
        out[str(batch)] = {}
        for statistic in ("median", "best"):
            slopes = {}
            for name in SCHEDULES:
                rows = sorted((p for p in points if p["batch"] == batch and p["schedule"] == name),
                              key=lambda p: p["context"])
                slopes[name] = slope_us_per_1k([p["context"] for p in rows], [p[f"tpot_{statistic}_s"] for p in rows])
            out[str(batch)][statistic] = {"us_per_1k": slopes,
                                          "over_all_mla": {n: slopes[n] / slopes["all-MLA"] for n in SCHEDULES}}
    return out


def plot(results: dict, path: Path) -> None:
    """TPOT (median) and cache bytes (measured points, accounting lines) against context, one line per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({p["batch"] for p in results["points"]}):
        for name, colour in zip(SCHEDULES, ("tab:red", "tab:purple", "tab:blue")):
            rows = sorted((p for p in results["points"] if p["batch"] == batch and p["schedule"] == name),
                          key=lambda p: p["context"])
            xs = [p["context"] for p in rows]
            style = "-o" if batch == 1 else "--s"
            ax_t.plot(xs, [p["tpot_median_s"] * 1e3 for p in rows], style, color=colour, label=f"{name}, B={batch}")
            ax_m.plot(xs, [p["predicted_bytes"] / 2 ** 20 for p in rows], style[:-1], color=colour, alpha=0.5)
            ax_m.plot(xs, [p["measured_bytes"] / 2 ** 20 for p in rows], style[-1], color=colour,
                      label=f"{name}, B={batch}")
    ax_t.set(xlabel="context L (tokens)", ylabel="TPOT, median (ms)", title="time per output token")
    ax_m.set(xlabel="context L (tokens)", ylabel="cache (MiB)", yscale="log",
             title="cache held (markers) vs accounting (lines)")
    handles, labels = ax_t.get_legend_handles_labels()  # line and marker: both panels draw them so
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, frameon=False)  # below: hides no line
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(results: dict) -> str:
    """A table of every point and the slopes / ratios, as printed by the command."""
    lines = [f"{'B':>2} {'L':>7} {'schedule':<11} {'TPOT best':>10} {'median':>9} {'cache held':>12} "
             f"{'accounting':>12}  equal"]
    for p in results["points"]:
        lines.append(f"{p['batch']:>2} {p['context']:>7} {p['schedule']:<11} {p['tpot_best_s'] * 1e3:>8.2f}ms "
                     f"{p['tpot_median_s'] * 1e3:>7.2f}ms {p['measured_bytes']:>12,} {p['predicted_bytes']:>12,}  "
                     f"{p['measured_bytes'] == p['predicted_bytes']}")
    for batch, by_statistic in results["slopes"].items():
        for statistic, s in by_statistic.items():
            lines.append(f"B={batch}: {statistic} TPOT slope (µs per 1k context tokens) "
                         + ", ".join(f"{n} {s['us_per_1k'][n]:.1f} ({s['over_all_mla'][n]:.2f}x all-MLA)"
                                     for n in SCHEDULES))
    return "\n".join(lines)


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench decode", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="model size (its schedule is the hybrid)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768, 65536],
                        help="context lengths L")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="batch sizes B")
    parser.add_argument("--steps", type=int, default=40, help="decode steps N timed per point")
    parser.add_argument("--fill", default="random", choices=("random", "prefill"), help="how caches reach L")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per call of --fill prefill")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny contexts and few steps (seconds; for tests)")
    parser.add_argument("--save", action="store_true", help="write k3course/results/decode_bench.json and .png")
    add_options(parser, threads=1)  # 1: no OpenMP spin-waits on a shared machine
    args = parser.parse_args(options)
    if args.quick:
        args.contexts, args.batches, args.steps = [64, 256, 512], [1, 2], 3
    if min(args.contexts) < 0 or min(args.batches) < 1 or args.steps < 1:
        parser.error("--contexts must be ≥ 0, --batches ≥ 1 and --steps ≥ 1")
    return args


def main(options: list[str]) -> int:
    args = _options(options)
    print(f"settings: {apply_options(args.threads, args.return_freed_memory)}")
    results = run(K3Config.preset(args.preset), args.contexts, args.batches, args.steps, args.fill, args.chunk,
                  args.device)
    print(report(results))
    if args.save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "decode_bench.json").write_text(json.dumps(results, indent=1))
        plot(results, RESULTS / "decode_bench.png")
        print(f"saved {RESULTS / 'decode_bench.json'} and decode_bench.png")
    return 0 if all(p["measured_bytes"] == p["predicted_bytes"] for p in results["points"]) else 1
