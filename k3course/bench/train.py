"""bench train: training throughput of a K3 preset beside the dense Transformer of equal active parameters, eager
and compiled, in one run.

Each variant runs :func:`k3course.train.step.train_step` itself — forward with targets, backward, clipping, AdamW, the
MoE bias update — on the stdlib bytes that ``k3course train`` reads (its batches, so the router sees text),
``--grad-accum`` micro-batches of ``--batch × --seq`` bytes per step. A compiled variant is
:func:`k3course.train.step.compile_for_training`'s model; its first step compiles, and that time is reported apart.
Then the variants take turns over ``--rounds`` rounds (a busy spell of a shared machine slows all of them alike),
each timed by the best of ``--repeats`` steps per round. Printed: ms per step, tokens/s, K3 / dense in each mode
and compiled / eager for each model. ``--save`` writes them to ``k3course/results/train_bench.json``, which
lesson 12 shows (:func:`show_results`); ``--out`` saves them elsewhere.

``--sweep`` times the step instead at every sequence length T of ``--seqs`` with the same ``--bytes`` per step
(batch = bytes / T, one micro-batch), all (T, model, mode) variants taking turns in the same rounds: where K3
overtakes its dense baseline. At constant bytes a step's MLP, MoE and KDA work stay constant (O(T) per sequence,
the KDA state carried along it), while attention's grows with T (O(T²) per sequence: O(T) per byte).
``--save`` writes it to ``k3course/results/train_sweep.json`` (:func:`show_sweep` prints and draws it).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from k3course.baselines import dense_transformer
from k3course.bench import add_options, apply_options
from k3course.config import K3Config
from k3course.device import interleaved_best_seconds, machine
from k3course.train import RunOptions, Stepper, TrainConfig, build_model, text_batches
from k3course.train.config import run_corpus
from k3course.train.step import compile_for_training

RESULTS_FILE = Path(__file__).resolve().parents[1] / "results" / "train_bench.json"
SWEEP_FILE = RESULTS_FILE.with_name("train_sweep.json")
SWEEP_SEQS = (128, 256, 512, 1024, 2048, 4096)  # --sweep's sequence lengths T (bytes)
MODES = ("eager", "compiled", "torch ops")  # "torch ops": eager with chapter 08's Triton kernels switched off


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny"], help="K3Config presets to time (default: tiny)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per micro-batch (default 16)")
    parser.add_argument("--seq", type=int, default=128, help="bytes per sequence (default 128)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None,
                        help="eager, compiled, and on a GPU 'torch ops' (eager without the Triton kernels) "
                             "(default: eager compiled; with --sweep: eager)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda (default: cpu)")
    parser.add_argument("--sweep", action="store_true",
                        help="time one preset at every --seqs length with --bytes per step (batch = bytes / T)")
    parser.add_argument("--bytes", type=int, default=4096, help="--sweep: bytes per step (default 4096)")
    parser.add_argument("--seqs", type=int, nargs="+", default=list(SWEEP_SEQS),
                        help="--sweep: sequence lengths, each dividing --bytes (default "
                             f"{' '.join(map(str, SWEEP_SEQS))})")
    parser.add_argument("--save", action="store_true",
                        help=f"write the results to {RESULTS_FILE} (with --sweep: {SWEEP_FILE})")
    parser.add_argument("--out", type=Path, default=None, help="save the results as JSON here (default: don't)")
    add_options(parser, threads=0, repeats=3, rounds=3)
    args = parser.parse_args(options)
    args.modes = args.modes or (["eager"] if args.sweep else ["eager", "compiled"])
    for name in ("batch", "seq", "grad_accum", "bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.sweep and (len(args.presets) != 1 or any(seq < 1 or args.bytes % seq for seq in args.seqs)):
        parser.error(f"--sweep needs one of --presets and --seqs that divide --bytes {args.bytes}, got presets "
                     f"{args.presets} and seqs {args.seqs}")
    return args


def variants(cfg: K3Config) -> dict[str, K3Config]:
    """The two models compared: the K3 preset and the dense Transformer of its active parameters."""
    return {cfg.name: cfg, f"dense ({cfg.name})": dense_transformer(cfg)}


def step_function(cfg: K3Config, train: TrainConfig, mode: str, device: str) -> tuple[Callable[[], dict], float]:
    """(one training step of a seeded model of ``cfg``, seconds its first step took: the compile time when
    ``mode`` is "compiled"; "torch ops": the model built with the kernel backend "torch", no Triton kernel).
    Each call trains on the next batches of the stdlib bytes."""
    kernels = "torch" if mode == "torch ops" else None
    stepper = Stepper(cfg, train, text_batches(run_corpus(RunOptions()).train, train, device), device,
                      model_factory=functools.partial(build_model, kernels=kernels))
    if mode == "compiled":
        compile_for_training(stepper.model, train)
    began = time.perf_counter()
    stepper()
    first = time.perf_counter() - began
    stepper()  # warm
    return stepper, first


def measure(presets: list[str], train: TrainConfig, modes: list[str], device: str = "cpu", repeats: int = 3,
            rounds: int = 3) -> dict:
    """{"tokens_per_step", "rows": [{"model", "mode", "step_s", "tokens_per_s", "first_step_s"}], "ratios":
    {preset: {"eager": K3 / dense, "compiled": ..., "K3 compiled / eager": ..., "dense compiled / eager": ...}}}."""
    calls, first = {}, {}
    for preset in presets:
        for name, cfg in variants(K3Config.preset(preset)).items():
            for mode in modes:
                calls[(name, mode)], first[(name, mode)] = step_function(cfg, train, mode, device)
    best = interleaved_best_seconds({key: (fn, repeats) for key, fn in calls.items()}, rounds, device)
    rows = [{"model": name, "mode": mode, "step_s": seconds, "tokens_per_s": train.tokens_per_step / seconds,
             "first_step_s": first[(name, mode)]} for (name, mode), seconds in best.items()]
    ratios = {}
    for preset in presets:
        dense = f"dense ({preset})"
        ratios[preset] = {f"K3 / dense, {mode}": best[(preset, mode)] / best[(dense, mode)] for mode in modes}
        for other in ("compiled", "torch ops"):
            if other in modes and "eager" in modes:
                ratios[preset] |= {f"{name} {other} / eager": best[(name, other)] / best[(name, "eager")]
                                   for name in (preset, dense)}
    return {"tokens_per_step": train.tokens_per_step, "rows": rows, "ratios": ratios}


def report(results: dict) -> str:
    """The table (ms per step, tokens/s, first step) and the ratios, as text."""
    lines = [f"{'model':<14} {'mode':<9} {'ms/step':>9} {'tokens/s':>10} {'first step':>11}"]
    for row in results["rows"]:
        lines.append(f"{row['model']:<14} {row['mode']:<9} {row['step_s'] * 1e3:9.1f} {row['tokens_per_s']:10,.0f} "
                     f"{row['first_step_s']:10.1f}s")
    for preset, ratios in results["ratios"].items():
        lines.append(f"{preset}: " + "; ".join(f"{name} {value:.2f}x" for name, value in ratios.items()))
    return "\n".join(lines)


def show_results(path: Path = RESULTS_FILE, axes=None) -> dict:
    """Print a saved ``bench train`` result (its settings, the table and the ratios) and, given matplotlib
    ``axes``, draw tokens/s per model, eager beside compiled. Returns the result."""
    results = json.loads(path.read_text())
    print(f"{results['command']} on {results['machine']}: {results['settings']}")
    print(report(results))
    if axes is not None:
        models = list(dict.fromkeys(row["model"] for row in results["rows"]))
        modes = list(dict.fromkeys(row["mode"] for row in results["rows"]))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            rate = {row["model"]: row["tokens_per_s"] for row in results["rows"] if row["mode"] == mode}
            axes.bar([m + i * width for m in range(len(models))], [rate.get(model, 0) for model in models], width,
                     label=mode)
        axes.set_xticks([m + width * (len(modes) - 1) / 2 for m in range(len(models))], models)
        axes.set_ylabel("training tokens / s")
        axes.set_title(f"one training step, {results['tokens_per_step']} bytes ({results['device']})")
        axes.legend()
    return results


def measure_sweep(preset: str, bytes_per_step: int, seqs: Sequence[int], modes: list[str], device: str = "cpu",
                  repeats: int = 3, rounds: int = 3) -> dict:
    """The step of ``preset`` and of its dense baseline at each T in ``seqs``, batch = ``bytes_per_step`` / T,
    every (T, model, mode) timed in the same interleaved rounds. Returns {"preset", "bytes_per_step", "points":
    [{"seq_len", "batch_size", "mode", "k3_step_s", "dense_step_s", "ratio": K3 / dense}]} in T order."""
    models = variants(K3Config.preset(preset))
    calls = {}
    for seq in seqs:
        train = TrainConfig(batch_size=bytes_per_step // seq, seq_len=seq)
        for name, cfg in models.items():
            for mode in modes:
                calls[(seq, name, mode)] = step_function(cfg, train, mode, device)[0], repeats
    best = interleaved_best_seconds(calls, rounds, device)
    k3, dense = models
    points = [{"seq_len": seq, "batch_size": bytes_per_step // seq, "mode": mode,
               "k3_step_s": best[(seq, k3, mode)], "dense_step_s": best[(seq, dense, mode)],
               "ratio": best[(seq, k3, mode)] / best[(seq, dense, mode)]} for seq in seqs for mode in modes]
    return {"preset": preset, "bytes_per_step": bytes_per_step, "points": points}


def sweep_report(results: dict) -> str:
    """The sweep's table (ms per step of both models and K3 / dense at each T and mode), as text."""
    lines = [f"{'T':>5} {'batch':>5} {'mode':<9} {'K3 ms':>9} {'dense ms':>9} {'K3 / dense':>10}"]
    for point in results["points"]:
        lines.append(f"{point['seq_len']:5d} {point['batch_size']:5d} {point['mode']:<9} "
                     f"{point['k3_step_s'] * 1e3:9.1f} {point['dense_step_s'] * 1e3:9.1f} {point['ratio']:9.2f}x")
    return "\n".join(lines)


def show_sweep(path: Path = SWEEP_FILE, axes=None) -> dict:
    """Print a saved ``bench train --sweep`` (its machine and settings, the table) and, given matplotlib ``axes``,
    draw ms per step of K3 and of the dense baseline against T (log–log), one pair of lines per mode, with
    K3 / dense written at each T. Returns the result."""
    results = json.loads(path.read_text())
    print(f"{results['command']} on {results['machine']} (torch {results['torch']}): {results['settings']}")
    print(sweep_report(results))
    if axes is not None:
        for mode in dict.fromkeys(point["mode"] for point in results["points"]):
            points = [point for point in results["points"] if point["mode"] == mode]
            seqs = [point["seq_len"] for point in points]
            axes.plot(seqs, [p["k3_step_s"] * 1e3 for p in points], "o-", label=f"{results['preset']} K3, {mode}")
            axes.plot(seqs, [p["dense_step_s"] * 1e3 for p in points], "s--", label=f"dense, {mode}")
            for point in points:
                axes.annotate(f"{point['ratio']:.2f}×", (point["seq_len"], point["k3_step_s"] * 1e3),
                              textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("sequence length T (batch = bytes / T)")
        axes.set_ylabel("ms per training step")
        axes.set_title(f"{results['bytes_per_step']} bytes per step ({results['device']}); K3 / dense above K3")
        axes.legend()
    return results


def main(options: list[str]) -> int:
    args = _options(options)
    settings = apply_options(args.threads, args.return_freed_memory)
    began = time.perf_counter()
    if args.sweep:
        print(f"settings: {settings}; {args.bytes} bytes per step at T = {args.seqs} on {args.device}")
        results = measure_sweep(args.presets[0], args.bytes, args.seqs, args.modes, args.device, args.repeats,
                                args.rounds)
        text, saved = sweep_report(results), SWEEP_FILE
    else:
        train = TrainConfig(batch_size=args.batch, seq_len=args.seq, grad_accum=args.grad_accum)
        print(f"settings: {settings}; {args.grad_accum} × {args.batch} × {args.seq} bytes per step on {args.device}")
        results = measure(args.presets, train, args.modes, args.device, args.repeats, args.rounds)
        text, saved = report(results), RESULTS_FILE
    results |= {"command": "k3course bench train " + " ".join(options), "machine": machine(),
                "torch": torch.__version__, "threads": torch.get_num_threads(),
                "settings": f"{settings}; {args.rounds} interleaved rounds, best of {args.repeats} steps each",
                "device": args.device, "seconds": time.perf_counter() - began}
    print(text)
    print(f"(took {results['seconds']:.0f} s)")
    for path in [saved] * args.save + [args.out] * (args.out is not None):
        path.write_text(json.dumps(results, indent=1))
        print(f"saved {path}")
    return 0
