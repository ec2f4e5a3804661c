"""``k3course experiments NAME``: the runs behind chapter 12's claims, saved as JSON inside the package.

Each experiment is a function of its settings that returns plain data; :func:`main` runs one and writes
``k3course/results/NAME.json`` with the command that made it, its settings and every run's per-step losses,
so a saved number can be regenerated (``k3course experiments NAME``) and checked (a test replays the first
steps of a saved run and must get the saved losses exactly on the machine that made them, and to float32
rounding on a CPU whose kernels sum in another order; the saved ``machine`` says which).

tiny-default     ``k3course train`` with its defaults (the tiny K3, 800 steps on the stdlib bytes): per-step metrics,
                 validation bits/byte against the n-gram and lzma baselines of the same split, a generated sample.
mqar-mixers      KDA vs Gated DeltaNet vs decayed linear attention on harder MQAR (20 pairs in 16-channel heads:
                 more pairs than a head's state has dimensions), the same small recall model around each.
dense-baseline   the tiny K3 vs a dense Transformer of equal active parameters, and a sample of each.
dense-baseline-default  the same at the default run's budget (800 steps of 16 × 128 bytes), and the dense model
                 again for the tiny K3's wall time (equal time).
hybrid-ratio     KDA:MLA 0:1 (all-MLA, RoPE), 1:1, 3:1, 7:1, all-KDA and the NoPE all-MLA ablation in an 8-layer K3,
                 validation bits/byte.
hybrid-mqar      the same six schedules trained on the harder MQAR, held-out recall accuracy.
residuals        PreNorm vs Block vs Full AttnRes in the same 8-layer, 64-wide K3.
balancing        quantile balancing vs the sign rule vs the aux loss: max-violation per step and final loss.
latent-moe       full-width vs latent MoE at equal active FLOPs (as published: n·d/ℓ experts, k·d/ℓ active; and the
                 same n, k with wider experts), with all-to-all bytes per token.
expert-count     8, 32 and 112 routed experts at top-2 and fixed expert width (activation ratio 25% → 1.8%).
hybrid-ratio-default, residuals-default, latent-moe-default  those claims at the default run's budget (800 steps of
                 16 × 128 bytes), where the tiny K3 is past its first steps (1.99 bits/byte).
mqar-sweep       the cheapest harder-MQAR setting (steps, pairs, head width; more pairs than head channels) at which
                 a mixer solves recall in most seeds, and the three mixers compared there.
mqar-controlled  at the sweep's chosen cell, KDA (three layouts of its starting decays, one of them GDN's per head),
                 GDN and decayed linear attention, each at its own learning rate by the tuning rule
                 (:mod:`k3course.lessons.tuning`); mqar-controlled-8 the same in 8-channel heads.
mqar-depth       hybrid-mqar's all-KDA K3 at 2 layers and at 8 (the claim "depth"), each at its own tuned rate: where
                 §6.2's all-KDA and §6.3's 2-layer recall model part (its 8-layer runs are hybrid-mqar's, copied).
tuning-horizon   the tuning rule's short-horizon bias on latent-moe: each variant's full-length seed-0 run at every
                 rate its quarter-length tuning tried, and which ends lowest.

Every claim at 120 steps of 8 × 64 bytes (the names without "-default") measures how fast a variant starts to
learn; the "-default" ones decide the four text claims, each verdict by
:func:`~k3course.lessons.seed_statistics.paired`. ``--budget gpu`` runs the
four text claims (:data:`GPU_CLAIMS`) on a CUDA GPU at :data:`GPU_TEXT_TRAIN`, saved as ``NAME-gpu.json``.

The claim experiments (all but tiny-default and the recall-model ones: mqar-mixers, mqar-sweep, mqar-controlled)
train each variant of :mod:`k3course.lessons.claims` for every seed with one runner,
:func:`k3course.lessons.claims.run_variant`, on one thread per run, each variant at its own learning rate from one
shared grid, chosen by :mod:`k3course.lessons.tuning`'s rule before its seeds run (tuned alike); ``--jobs N`` trains
N runs at a time in separate processes (the same numbers: each run is seeded and single-threaded, whichever process
runs it). A run (or tuning run) that a saved result already holds with the same config, settings, seed, task and
device is copied from it, not trained again (:func:`saved_runs`): residuals' Block AttnRes is hybrid-ratio's 3:1,
expert-count's 8 experts is balancing's quantile, mqar-depth's 8 layers is hybrid-mqar's all-KDA.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch

from k3course import accounting
from k3course.config import K3Config, from_saved_fields
from k3course.data import cache_dir, mqar
from k3course.device import interleaved_best_seconds, keep_freed_memory, machine, on_cuda
from k3course.guards import is_number
from k3course.lessons import claims, tuning
from k3course.lessons.fit import cross_entropy_at, fit
from k3course.lessons.recall import (
    MIXERS,
    RecallModel,
    decay_ranges,
    recall_accuracy,
    recall_by_pair,
)
from k3course.params import param_groups
from k3course.train import TrainConfig

RESULTS = Path(__file__).resolve().parents[1] / "results"
MQAR_SETTINGS = dict(steps=300, batch_size=16, lr=5e-3, warmup_steps=30, d_model=32, n_heads=2, seeds=(0, 1, 2))
# The sweep for harder MQAR: more pairs than a head has channels (12 or 20 pairs in heads of 8 or 16 channels, so
# keys cannot all be orthogonal), 500-6000 steps.
MQAR_SWEEP = dict(steps=(500, 1500, 3000, 6000), n_pairs=(20, 12), head_dims=(8, 16), batch_size=16, lr=5e-3,
                  warmup_steps=30, n_heads=2, seeds=(0, 1, 2), solved=0.9)


@contextlib.contextmanager
def torch_threads(count: int):
    """Run the block with ``torch.set_num_threads(count)``, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def recall_run(mixer: str, settings: TrainConfig, d_model: int, n_heads: int, *,
               n_pairs: int = claims.MQAR_TASK["n_pairs"], stop_after: int | None = None, **kda_options) -> dict:
    """Train a :class:`RecallModel` with ``mixer`` (KDA: with ``kda_options``, decay_init and lower_bound) of
    ``n_heads`` heads and width ``d_model`` on :data:`k3course.lessons.claims.MQAR_TASK` with ``n_pairs`` pairs;
    {"losses", "accuracy", "accuracy_by_pair" (:func:`~k3course.lessons.recall.recall_by_pair`), "starting_decays"
    (:meth:`RecallModel.starting_decays`), "seconds"}.

    From ``settings`` (:func:`recall_settings`) it reads the seed, steps, batch_size, lr, warmup_steps,
    min_lr_ratio and gate_lr_scale: :func:`k3course.lessons.fit.fit` with AdamW (torch's betas, no weight decay,
    no clipping) at lr · f(step), f the package's warmup + cosine, the forget gates' parameters at
    ``gate_lr_scale`` × that (:func:`k3course.params.param_groups`); batch ``step`` is ``mqar(..., seed=seed·10⁶ +
    step)``; accuracy on 256 held-out sequences (seed 10⁹ + seed). ``stop_after`` ends the run early without
    changing any earlier step (for replaying a saved run).
    """
    task, seed = {**claims.MQAR_TASK, "n_pairs": n_pairs}, settings.seed
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = RecallModel(task["vocab_size"], mixer, d_model=d_model, n_heads=n_heads, **kda_options)
    starting_decays = model.starting_decays()
    groups = param_groups(model.parameters(), weight_decay=0.0, gate_lr_scale=settings.gate_lr_scale, lr=settings.lr)
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, weight_decay=0.0)
    began = time.perf_counter()
    batch_at = lambda step: mqar(settings.batch_size, seed=seed * 10**6 + step, **task)
    losses = fit(optimizer, settings.steps, cross_entropy_at(model, batch_at), warmup_steps=settings.warmup_steps,
                 min_lr_ratio=settings.min_lr_ratio, stop_after=stop_after)
    held_out = mqar(claims.MQAR_HELD_OUT, seed=10**9 + seed, **task)
    return {"losses": losses, "accuracy": recall_accuracy(model, *held_out),
            "accuracy_by_pair": recall_by_pair(model, *held_out, n_pairs), "starting_decays": starting_decays,
            "seconds": time.perf_counter() - began}


def mqar_mixers(steps: int, batch_size: int, lr: float, warmup_steps: int, d_model: int, n_heads: int,
                seeds: tuple[int, ...]) -> dict:
    """Every mixer of :data:`k3course.lessons.recall.MIXERS` × every seed:
    {"task": the MQAR setting, "torch_threads": 1, "runs": [{"mixer", "seed", ...run}, ...]}, on one thread."""
    runs = []
    with torch_threads(1):
        for mixer in MIXERS:
            for seed in seeds:
                settings = recall_settings(steps, batch_size, warmup_steps).replace(lr=lr, seed=seed)
                runs.append({"mixer": mixer, "seed": seed, **recall_run(mixer, settings, d_model, n_heads)})
                print(f"mqar-mixers: {mixer}, seed {seed}: {runs[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    return {"task": claims.MQAR_TASK, "torch_threads": 1, "runs": runs}


def sweep_cells(steps: tuple[int, ...], n_pairs: tuple[int, ...], head_dims: tuple[int, ...]) -> list[dict]:
    """Every (steps, n_pairs, head_dim) with more pairs than head channels (harder MQAR: the keys cannot all be
    orthogonal) as {"steps", "n_pairs", "head_dim"}, cheapest first: by steps × head_dim (a recall step's time
    grows about linearly in the width here), then the most pairs first (the harder task at the same cost)."""
    cells = [{"steps": s, "n_pairs": p, "head_dim": h} for s in steps for p in n_pairs for h in head_dims if p > h]
    return sorted(cells, key=lambda cell: (cell["steps"] * cell["head_dim"], -cell["n_pairs"]))


def solved_seeds(runs: list[dict], mixer: str, solved: float) -> int:
    """How many of ``mixer``'s runs reached held-out recall accuracy ≥ ``solved``."""
    return sum(run["accuracy"] >= solved for run in runs if run["mixer"] == mixer)


def cell_run(cell: dict, mixer: str, seed: int, batch_size: int, lr: float, warmup_steps: int, n_heads: int,
             stop_after: int | None = None) -> dict:
    """One :func:`recall_run` of a sweep cell {"steps", "n_pairs", "head_dim"}: {"mixer", "seed", ...run}."""
    settings = recall_settings(cell["steps"], batch_size, warmup_steps).replace(lr=lr, seed=seed)
    run = recall_run(mixer, settings, n_heads * cell["head_dim"], n_heads, n_pairs=cell["n_pairs"],
                     stop_after=stop_after)
    return {"mixer": mixer, "seed": seed, **run}


def mqar_sweep(steps: tuple[int, ...], n_pairs: tuple[int, ...], head_dims: tuple[int, ...], batch_size: int,
               lr: float, warmup_steps: int, n_heads: int, seeds: tuple[int, ...], solved: float) -> dict:
    """The cheapest harder-MQAR setting at which a mixer of :data:`k3course.lessons.recall.MIXERS` learns recall,
    and the three mixers compared there over ``seeds``.

    Walks :func:`sweep_cells` in order. In each cell every mixer trains on the first seed (:func:`recall_run`, a
    :class:`RecallModel` of ``n_heads`` heads of ``head_dim`` channels); if one reaches held-out accuracy ≥
    ``solved``, every mixer trains on the other seeds too, and the cell is chosen if some mixer is solved in most
    seeds (more than half). The walk stops at the chosen cell. Returns {"task", "cells": [{**cell, "runs":
    [{"mixer", "seed", ...run}]}], "chosen": the chosen cell's index or None, "torch_threads": 1}.
    """
    cells, chosen = [], None
    with torch_threads(1):
        for cell in sweep_cells(steps, n_pairs, head_dims):
            train = functools.partial(cell_run, cell, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps,
                                      n_heads=n_heads)
            runs = [train(mixer, seeds[0]) for mixer in MIXERS]
            if any(run["accuracy"] >= solved for run in runs):
                runs += [train(mixer, seed) for mixer in MIXERS for seed in seeds[1:]]
            cells.append({**cell, "runs": runs})
            best = max(solved_seeds(runs, mixer, solved) for mixer in MIXERS)
            print(f"mqar-sweep: {cell}: best mixer solved {best}/{len(seeds)} seeds", file=sys.stderr, flush=True)
            if 2 * best > len(seeds):
                chosen = len(cells) - 1
                break
    task = {k: v for k, v in claims.MQAR_TASK.items() if k != "n_pairs"}
    return {"task": task, "cells": cells, "chosen": chosen, "torch_threads": 1}


def sweep_comparison(result: dict) -> dict:
    """The chosen cell of a :func:`mqar_sweep` result as a claim-like result {"runs"} keyed by "mixer" (for
    :func:`~k3course.lessons.seed_statistics.spread` and :func:`~k3course.lessons.seed_statistics.paired`); ValueError
    if the sweep chose none."""
    if result["chosen"] is None:
        raise ValueError("result: the sweep found no cell where a mixer solves MQAR in most seeds")
    return {"runs": result["cells"][result["chosen"]]["runs"]}


def sweep_table(result: dict, seed: int = 0) -> str:
    """The cells a :func:`mqar_sweep` tried, in the order it tried them, as a text table: steps, pairs, head
    channels, then each mixer's held-out recall accuracy at ``seed``, the chosen cell marked."""
    mixers = list(dict.fromkeys(run["mixer"] for cell in result["cells"] for run in cell["runs"]))
    rows = [f"{'steps':>6} {'pairs':>6} {'head channels':>14}" + "".join(f"{m:>16}" for m in mixers)
            + f"   (accuracy, seed {seed})"]
    for index, cell in enumerate(result["cells"]):
        accuracy = {run["mixer"]: run["accuracy"] for run in cell["runs"] if run["seed"] == seed}
        rows.append(f"{cell['steps']:>6} {cell['n_pairs']:>6} {cell['head_dim']:>14}"
                    + "".join(f"{accuracy[m]:>16.3f}" for m in mixers) + ("   <- chosen" if index == result["chosen"]
                                                                           else ""))
    return "\n".join(rows)


# --- MQAR, controlled: the mixers started alike and tuned alike (issue 38) -----------------------------------

# label -> how recall_run builds it: the mixer and KDA's options. GDN and decayed linear attention start head h at
# −g = logspace(0.01, 0.5, H)[h]; "KDA (per head)" starts every channel of head h there too; the other two KDA layouts
# spread 0.01 → 0.5 over channels.
CONTROLLED_VARIANTS = {"KDA (per head)": {"mixer": "KDA", "decay_init": "per_head"},
                       "KDA (within heads)": {"mixer": "KDA", "decay_init": "within_heads"},
                       "KDA (across heads, K3)": {"mixer": "KDA", "decay_init": "across_heads"},
                       "GDN": {"mixer": "GDN"}, "decayed linear": {"mixer": "decayed linear"}}
# The sweep's chosen cell (20 pairs in heads of 16 channels, 1500 steps) and its 8-channel neighbour.
MQAR_CONTROLLED = dict(steps=1500, n_pairs=20, head_dim=16, n_heads=2, batch_size=16, warmup_steps=30,
                       gate_lr_scale=1.0, lr_grid=tuning.LR_GRID, seeds=(0, 1, 2))
MQAR_CONTROLLED_8 = {**MQAR_CONTROLLED, "head_dim": 8}


def recall_settings(steps: int, batch_size: int, warmup_steps: int, gate_lr_scale: float = 1.0) -> TrainConfig:
    """The training settings of a recall run as a TrainConfig (lr left at its default: the tuning sets it), for
    :func:`k3course.lessons.tuning.tuning_settings`."""
    return TrainConfig(steps=steps, batch_size=batch_size, seq_len=claims.MQAR_TASK["seq_len"], weight_decay=0.0,
                       warmup_steps=warmup_steps, gate_lr_scale=gate_lr_scale, eval_every=0, checkpoint_every=0)


def tuned_lr(train_at, grid) -> dict:
    """The rate :mod:`k3course.lessons.tuning`'s rule picks: ``train_at(lr)`` -> the per-step losses of the tuning
    run at ``lr``, for every rate of ``grid``, then at :func:`~k3course.lessons.tuning.extension`'s rate past an
    edge winner. {"lr_grid", "trials": [{"lr", "tail_loss", "losses"}] (sorted by rate, the extension included),
    "lr"}."""
    grid = tuning.check_grid(grid)
    trials = {lr: train_at(lr) for lr in grid}
    beyond = tuning.extension(grid, trials)
    if beyond is not None:
        trials[beyond] = train_at(beyond)
    return {"lr_grid": list(grid), "trials": [{"lr": lr, "tail_loss": tuning.tail_loss(trials[lr]),
                                               "losses": trials[lr]} for lr in sorted(trials)],
            "lr": tuning.choose_lr(trials)}


def controlled_run(variant: str, settings: TrainConfig, n_pairs: int, head_dim: int, n_heads: int,
                   stop_after: int | None = None) -> dict:
    """One :func:`recall_run` of a :data:`CONTROLLED_VARIANTS` label with ``settings`` (steps, batch, lr, warmup,
    gate_lr_scale, seed) in heads of ``head_dim`` channels."""
    options = dict(CONTROLLED_VARIANTS[variant])
    mixer = options.pop("mixer")
    return recall_run(mixer, settings, n_heads * head_dim, n_heads, n_pairs=n_pairs, stop_after=stop_after,
                      **options)


def mqar_controlled(steps: int, n_pairs: int, head_dim: int, n_heads: int, batch_size: int, warmup_steps: int,
                    gate_lr_scale: float, lr_grid: tuple[float, ...], seeds: tuple[int, ...]) -> dict:
    """Every :data:`CONTROLLED_VARIANTS` mixer on MQAR with ``n_pairs`` pairs in ``n_heads`` heads of ``head_dim``
    channels, each at its own learning rate: :func:`tuned_lr` over ``lr_grid`` on the tuning run
    (:func:`k3course.lessons.tuning.tuning_settings` of these settings), then every seed at the full ``steps``.

    Returns {"task", "rule", "variants": {label: {"mixer", KDA's options, "gate_lr_scale", "starting_decays"
    ([min, max] of −g at z = 0 per head, first layer), "lr_grid", "trials", "lr"}}, "runs": [{"variant", "seed",
    ...run}], "torch_threads": 1}, on one thread.
    """
    settings = recall_settings(steps, batch_size, warmup_steps, gate_lr_scale)
    short = tuning.tuning_settings(settings)
    shape = dict(n_pairs=n_pairs, head_dim=head_dim, n_heads=n_heads)
    records, runs = {}, []
    with torch_threads(1):
        for label in CONTROLLED_VARIANTS:
            chosen = tuned_lr(lambda lr, label=label: controlled_run(label, short.replace(lr=lr), **shape)["losses"],
                              lr_grid)
            print(f"mqar-controlled: {label}: lr {chosen['lr']:g}", file=sys.stderr, flush=True)
            for seed in seeds:
                run = controlled_run(label, settings.replace(lr=chosen["lr"], seed=seed), **shape)
                runs.append({"variant": label, "seed": seed, **run})
                print(f"mqar-controlled: {label}, seed {seed}: {run['accuracy']:.3f} in {run['seconds']:.0f} s",
                      file=sys.stderr, flush=True)
            records[label] = {**CONTROLLED_VARIANTS[label], "gate_lr_scale": gate_lr_scale,
                              "starting_decays": runs[-1]["starting_decays"], **chosen}
    return {"task": {**claims.MQAR_TASK, "n_pairs": n_pairs}, "rule": tuning.RULE, "variants": records, "runs": runs,
            "torch_threads": 1}


def tuned_variants_table(result: dict) -> str:
    """A result of :func:`mqar_controlled` (each variant's tuning kept with the variant) as a text table, one row
    per variant: the starting decays per head ([min, max] of −g at z = 0 over its channels), the tuning run's tail
    loss at each rate it ran at (the grid and a run past its edge; the chosen one starred), and the held-out recall
    accuracy of the seeds."""
    variants = result["variants"]
    rates = tuning.rates_tried(variant["trials"] for variant in variants.values())
    width = max(len(label) for label in variants) + 2
    rows = [f"{'variant':<{width}}{'starting decays per head':<30}" + "".join(f"{f'lr {lr:g}':>11}" for lr in rates)
            + "   accuracy: mean [min, max]"]
    for label, variant in variants.items():
        decays = " ".join(f"{low:.2g}" if low == high else f"{low:.2g}–{high:.2g}"
                          for low, high in variant["starting_decays"])
        tails = tuning.trial_cells(variant["trials"], rates, variant["lr"], 11)
        accuracy = [run["accuracy"] for run in result["runs"] if run["variant"] == label]
        rows.append(f"{label:<{width}}{decays:<30}{tails}   {sum(accuracy) / len(accuracy):.3f} "
                    f"[{min(accuracy):.3f}, {max(accuracy):.3f}]")
    return "\n".join(rows)


def describe(cfg) -> dict:
    """What a claim's table shows about a variant: its config, parameters, schedule and MoE accounting."""
    count = accounting.param_count(cfg)
    return {"config": dataclasses.asdict(cfg), "total_params": count.total, "active_params": count.active,
            "layers": "".join("K" if kind == "kda" else "M" for kind in cfg.layer_types()),
            "moe_flops_per_token": claims.moe_flops(cfg), "all_to_all_bytes_per_token": claims.all_to_all_bytes(cfg),
            "activation_ratio": accounting.activation_ratio(cfg)}


def _train_variant(label: str, cfg, settings: TrainConfig, seed: int, task: str, prompt: str | None,
                   device: str, stop_after: int | None = None) -> dict:
    """One run of a claim experiment, on one thread (called in this process or in a worker); ``stop_after``: a
    tuning run (losses only, no evaluation)."""
    with torch_threads(1):
        began = time.perf_counter()
        run = {"variant": label, "seed": seed,
               **claims.run_variant(cfg, settings, seed, task, stop_after=stop_after, sample_prompt=prompt,
                                    device=device)}
        run.setdefault("seconds", time.perf_counter() - began)
    print(f"{label}, seed {seed}, lr {settings.lr:g}{' (tuning)' if stop_after else ''}: {run['seconds']:.0f} s",
          file=sys.stderr, flush=True)
    return run


def _train_job(job: tuple) -> dict:
    """:func:`_train_variant` of one job tuple (a pool's ``imap`` hands one argument)."""
    return _train_variant(*job)


# Where each run is kept once it has trained, until its experiment saves it (outside the package: an interrupted
# experiment's finished runs, not a result).
FINISHED_RUNS = cache_dir() / "finished-runs"


def _finished_path(key: str) -> Path:
    """The file of the run with :func:`run_key` ``key`` in :data:`FINISHED_RUNS`: SHA256(key).json."""
    return FINISHED_RUNS / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def _finished_run(key: str) -> dict | None:
    """The run of ``key`` trained by an earlier, interrupted invocation of an experiment (None: not trained)."""
    path = _finished_path(key)
    if not path.exists():
        return None
    kept = json.loads(path.read_text())
    return kept["run"] if kept["key"] == key else None


def _keep_finished(key: str, run: dict) -> dict:
    """Write ``run`` to :func:`_finished_path` (atomically) as soon as it has trained; returns it."""
    path = _finished_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({"key": key, "run": run}))
    partial.replace(path)
    return run


def _train_all(todo: list[tuple], jobs: int, task: str) -> list[dict]:
    """:func:`_train_variant` of every job (label, cfg, settings, seed, prompt, device, stop_after), ``jobs`` at a
    time in spawned processes; a job whose run is already saved (:func:`saved_runs`) is copied, not trained. Each
    run is kept as it finishes (:func:`_keep_finished`), so an experiment stopped half-way starts again where it
    stopped: its finished runs are taken back as they were, the same runs as an uninterrupted invocation's."""
    saved = saved_runs()
    keys = [run_key(cfg, settings, seed, task, device, stop_after)
            for _, cfg, settings, seed, _, device, stop_after in todo]
    finished = {key: run for key in keys if key not in saved and (run := _finished_run(key)) is not None}
    fresh = [((label, cfg, settings, seed, task, prompt, device, stop_after), key)
             for (label, cfg, settings, seed, prompt, device, stop_after), key in zip(todo, keys)
             if key not in saved and key not in finished]
    if jobs > 1 and len(fresh) > 1:
        with multiprocessing.get_context("spawn").Pool(jobs, initializer=keep_freed_memory) as pool:
            runs = pool.imap(_train_job, [job for job, _ in fresh])  # in order, each as soon as it is done
            finished.update((key, _keep_finished(key, run)) for (_, key), run in zip(fresh, runs))
    else:
        finished.update((key, _keep_finished(key, _train_variant(*job))) for job, key in fresh)
    return [{**saved[key][0], "variant": job[0], "reused_from": saved[key][1]} if key in saved else finished[key]
            for job, key in zip(todo, keys)]


def tune_learning_rates(variants: dict, settings: TrainConfig, task: str, grid: tuple[float, ...], jobs: int,
                        device: str) -> dict:
    """Each variant's learning rate by :mod:`k3course.lessons.tuning`'s rule: every rate of ``grid`` trained once
    at :func:`~k3course.lessons.tuning.tuning_settings` (seed 0, a quarter of the steps), then, for a variant whose
    lowest tail loss is at an edge of the grid, one run at :func:`~k3course.lessons.tuning.extension`'s rate past
    it; the lowest tail loss over all its runs wins.
    Returns {"grid", "rule", "settings": the tuning run's settings (its lr replaced per trial), "trials": {label:
    [{"lr", "tail_loss", "losses", "seconds"}, ...] sorted by rate, the extension included}, "extended": {label:
    the rate past the edge} for the variants that ran one, "chosen": {label: lr}}."""
    short = tuning.tuning_settings(settings)
    trials = _tuning_trials(variants, {label: grid for label in variants}, short, task, jobs, device)
    extended = {label: tuning.extension(grid, {t["lr"]: t["losses"] for t in trials[label]}) for label in variants}
    extended = {label: lr for label, lr in extended.items() if lr is not None}
    beyond = _tuning_trials({label: variants[label] for label in extended},
                            {label: (lr,) for label, lr in extended.items()}, short, task, jobs, device)
    trials = {label: sorted(trials[label] + beyond.get(label, []), key=lambda t: t["lr"]) for label in variants}
    chosen = {label: tuning.choose_lr({t["lr"]: t["losses"] for t in label_trials})
              for label, label_trials in trials.items()}
    return {"grid": list(grid), "rule": tuning.RULE, "settings": dataclasses.asdict(short), "trials": trials,
            "extended": extended, "chosen": chosen}


def _tuning_trials(variants: dict, rates: dict, short: TrainConfig, task: str, jobs: int,
                   device: str) -> dict[str, list[dict]]:
    """{label: [{"lr", ...:func:`_trial`}]}: each variant's tuning run (settings ``short``) at each of its
    ``rates[label]``."""
    todo = [(label, cfg, short.replace(lr=lr), short.seed, None, device, short.steps)
            for label, cfg in variants.items() for lr in rates[label]]
    runs = iter(_train_all(todo, jobs, task))
    return {label: [{"lr": lr, **_trial(next(runs))} for lr in rates[label]] for label in variants}


def _trial(run: dict) -> dict:
    """What a tuning run keeps: its tail loss, per-step losses, wall time and where it was copied from."""
    kept = {"tail_loss": tuning.tail_loss(run["losses"]), "losses": run["losses"], "seconds": run["seconds"]}
    return {**kept, **({"reused_from": run["reused_from"]} if "reused_from" in run else {})}


def claim_variants(claim: str, seeds: tuple[int, ...], task: str, train: dict, sample_prompt: str | None = None,
                   jobs: int = 1, equal_time: tuple[str, str] | None = None, device: str = "cpu",
                   lr_grid: tuple[float, ...] | None = None, more_seeds: dict | None = None) -> dict:
    """Every variant of ``claim`` (:data:`k3course.lessons.claims.CLAIMS`) × every seed, trained by
    :func:`k3course.lessons.claims.run_variant` with ``TrainConfig(**train)``:
    {"variants": {label: :func:`describe`}, "training": {label: :func:`variant_training`}, "torch_threads": 1,
    "runs": [{"variant", "seed", ...run}, ...]}, on one thread; the first seed's run of each variant also returns
    a sample after ``sample_prompt`` (if given).

    ``lr_grid``: tuned alike — each variant trains at its own rate, chosen from the grid by
    :func:`tune_learning_rates` (the result keeps the trials as "tuning"); None: every variant at ``train``'s rate.
    A run that a saved result already holds with the same config, settings, seed, task and device is copied from
    it (with a "reused_from" note), not trained again (:func:`saved_runs`). ``jobs`` > 1: that many runs at a
    time, each in its own process (spawned); the runs and their order are the same as with one.

    ``equal_time`` (slower, faster): then ``faster`` is trained once more per seed, for as many steps as it takes
    in the wall time of ``slower``'s steps (:func:`equal_time_steps` of the step times :func:`step_seconds`
    measures first, both models on one thread taking turns), on its own warmup + cosine schedule over those steps,
    as the variant "FASTER (equal time)" with its "steps"; the result keeps the step times ("step_seconds").
    ``device``: where every run trains (a CUDA device for :data:`GPU_BUDGET`'s runs).

    ``more_seeds`` {"variants": [label, ...], "seeds": [seed, ...]}: those variants also train those seeds (the
    pair of a comparison that its seeds left within reach of a verdict; the other variants keep ``seeds``).
    """
    variants = claims.CLAIMS[claim]()
    seeds_of = variant_seeds(variants, seeds, more_seeds)
    base = train_config(train)
    tuned = None if lr_grid is None else \
        tune_learning_rates(variants, base, task, tuning.check_grid(lr_grid), jobs, device)
    settings = {label: base if tuned is None else base.replace(lr=tuned["chosen"][label]) for label in variants}
    timing, equal = None, []
    if equal_time is not None:
        slower, faster = equal_time
        timing = step_seconds({label: variants[label] for label in equal_time}, base, device=device)
        steps = equal_time_steps(timing, slower, faster, base.steps)
        equal = [(equal_time_label(faster), variants[faster], settings[faster].replace(steps=steps), seed, None,
                  device, None) for seed in seeds]
    todo = [(label, cfg, settings[label], seed, sample_prompt if seed == seeds[0] else None, device, None)
            for label, cfg in variants.items() for seed in seeds_of[label]] + equal
    runs = _train_all(todo, jobs, task)
    described = {label: describe(cfg) for label, cfg in variants.items()}
    training = {label: variant_training(cfg, settings[label], tuned) for label, cfg in variants.items()}
    if equal_time is not None:
        label = equal_time_label(faster)
        runs = [{**run, "steps": steps} if run["variant"] == label else run for run in runs]
        described[label] = described[faster]
        training[label] = {**training[faster], "train": dataclasses.asdict(settings[faster].replace(steps=steps))}
    return {"variants": described, "training": training, "torch_threads": 1, "runs": runs,
            **({"tuning": tuned} if tuned else {}), **({"step_seconds": timing} if timing else {})}


def variant_seeds(variants: dict, seeds: tuple[int, ...], more_seeds: dict | None) -> dict[str, tuple[int, ...]]:
    """{label: the seeds it trains}: ``seeds``, then ``more_seeds["seeds"]`` for the variants it names."""
    more = more_seeds or {"variants": [], "seeds": []}
    if set(more) != {"variants", "seeds"} or not set(more["variants"]) <= set(variants):
        raise ValueError(f"more_seeds must be {{'variants': labels of {list(variants)}, 'seeds': [...]}}, "
                         f"got {more_seeds!r}")
    if set(more["seeds"]) & set(seeds):
        raise ValueError(f"more_seeds: seeds {more['seeds']} repeat some of {list(seeds)}")
    return {label: (*seeds, *(more["seeds"] if label in more["variants"] else ())) for label in variants}


def variant_training(cfg: K3Config, settings: TrainConfig, tuned: dict | None) -> dict:
    """How a variant was trained: its settings ("train", its own lr), the "lr_grid" it was chosen from ([lr] when
    untuned), the chosen "lr", the forget gates' "gate_lr_scale" and its "starting_decays" (:func:`starting_decays`)."""
    return {"train": dataclasses.asdict(settings), "lr_grid": tuned["grid"] if tuned else [settings.lr],
            "lr": settings.lr, "gate_lr_scale": settings.gate_lr_scale, "starting_decays": starting_decays(cfg)}


def starting_decays(cfg: K3Config) -> list[list[float]]:
    """Per KDA head of ``cfg``, the [slowest, fastest] forget rate −g its gate starts at (z = 0: the projection's
    input ignored, A_log = 0, g from dt_bias alone), as an initialised K3 layer holds it; [] without KDA layers."""
    if "kda" not in cfg.layer_types():
        return []
    from k3course.layers.kda import KimiDeltaAttention

    layer = KimiDeltaAttention(cfg.d_model, cfg.kda_n_heads, cfg.kda_head_dim, lower_bound=cfg.kda_lower_bound)
    return [[round(low, 6), round(high, 6)] for low, high in decay_ranges(layer.starting_decays())]


def run_key(cfg: K3Config, settings: TrainConfig, seed: int, task: str, device: str, stop_after: int | None) -> str:
    """What a run is a function of, as one string: config, training settings, seed, task, device and where it
    stops (a tuning run's losses only) — two runs with one key are the same run."""
    return json.dumps({"config": dataclasses.asdict(cfg), "train": dataclasses.asdict(settings), "seed": seed,
                       "task": task, "device": device, "stop_after": stop_after}, sort_keys=True)


def saved_runs() -> dict[str, tuple[dict, str]]:
    """{:func:`run_key`: (run, "EXPERIMENT: LABEL")} of every run and tuning trial in the saved claim results
    (first saved wins), so that a run trained once is not trained again."""
    found: dict[str, tuple[dict, str]] = {}
    for path in sorted(RESULTS.glob("*.json")):
        saved = json.loads(path.read_text())
        settings, result = saved.get("settings", {}), saved.get("result", {})
        if "claim" not in settings:
            continue
        device = settings.get("device", "cpu")
        configs = {label: K3Config.from_dict(facts["config"]) for label, facts in result["variants"].items()}
        for run in result["runs"]:
            trained = result.get("training", {}).get(run["variant"], {}).get("train", settings["train"])
            key = run_key(configs[run["variant"]], train_config(trained), run["seed"], settings["task"], device, None)
            found.setdefault(key, (run, f"{path.stem}: {run['variant']}"))
        tuned = result.get("tuning")
        for label, trials in (tuned or {}).get("trials", {}).items():
            short = train_config(tuned["settings"])
            for trial in trials:
                key = run_key(configs[label], short.replace(lr=trial["lr"]), short.seed, settings["task"], device,
                              short.steps)
                found.setdefault(key, ({"losses": trial["losses"], "seconds": trial["seconds"]},
                                       f"{path.stem}: {label} (tuning)"))
    return found


def tuning_horizon(claim_result: str) -> dict:
    """The tuning rule's short-horizon bias, checked on the saved claim ``claim_result``: every variant's full-length
    run (seed 0, the claim's own settings) at every rate its tuning tried, so that the rate the quarter-length runs
    chose can be set beside the rate that ends lowest at full length (final validation bits/byte, and the mean
    training loss over the last tenth, the rule's own measure). Runs the claim already holds are copied.

    Returns {"claim_result", "variants": {label: {"chosen": the rule's rate, "full": [{"lr", "val_bpb",
    "tail_loss"}] by rate, "lowest_val_bpb": its rate, "lowest_tail_loss": its rate}}, "runs": [...],
    "torch_threads": 1}."""
    saved = load(claim_result)
    settings, result = saved["settings"], saved["result"]
    if "claim" not in settings or "tuning" not in result or settings["task"] != "text":
        raise ValueError(f"claim_result: {claim_result} is not a tuned text claim")
    variants = claims.CLAIMS[settings["claim"]]()
    full = train_config(settings["train"])
    tried = {label: [trial["lr"] for trial in result["tuning"]["trials"][label]] for label in variants}
    todo = [(label, cfg, full.replace(lr=lr), 0, None, "cpu", None) for label, cfg in variants.items()
            for lr in tried[label]]
    runs = _train_all(todo, 1, "text")
    records = {}
    for label in variants:
        rows = [{"lr": lr, "val_bpb": run["val_bpb"], "tail_loss": tuning.tail_loss(run["losses"])}
                for lr, run in zip(tried[label], [run for run in runs if run["variant"] == label])]
        records[label] = {"chosen": result["tuning"]["chosen"][label], "full": rows,
                          **{f"lowest_{key}": min(rows, key=lambda row: row[key])["lr"]
                             for key in ("val_bpb", "tail_loss")}}
    return {"claim_result": claim_result, "variants": records,
            "runs": [{**run, "lr": todo[index][2].lr} for index, run in enumerate(runs)], "torch_threads": 1}


def equal_time_label(variant: str) -> str:
    """The label of ``variant`` trained for the wall time of another: "VARIANT (equal time)"."""
    return f"{variant} (equal time)"


def step_seconds(variants: dict, settings: TrainConfig, rounds: int = 5, repeats: int = 3,
                 device: str = "cpu") -> dict[str, float]:
    """{label: seconds per training step} of each variant on one thread (:func:`claims.text_training_steps`) on
    ``device``: the best of ``repeats`` steps in each of ``rounds`` rounds in which the variants take turns
    (:func:`k3course.device.interleaved_best_seconds`), so that a busy spell of the machine slows all alike."""
    with torch_threads(1):
        steppers = {label: claims.text_training_steps(cfg, settings, device) for label, cfg in variants.items()}
        return interleaved_best_seconds({label: (step, repeats) for label, step in steppers.items()}, rounds, device)


def equal_time_steps(step_seconds: dict[str, float], slower: str, faster: str, steps: int) -> int:
    """Steps ``faster`` takes in the wall time of ``steps`` steps of ``slower``: steps × its step time / faster's."""
    return round(steps * step_seconds[slower] / step_seconds[faster])


def train_config(train: dict) -> TrainConfig:
    """The TrainConfig of a settings dict (as saved in JSON: lists back to tuples)."""
    return from_saved_fields(TrainConfig, train)


def summarise_run(out: Path, prompt: str = "def ", max_new_tokens: int = 300) -> dict:
    """What a finished ``k3course train`` run in ``out`` shows: its metrics, the corpus it read, the baselines of
    that corpus, and a sample from its last checkpoint (temperature 0.8, top-k 20, seed 0)."""
    from k3course import checkpoint, data
    from k3course.train.generate import generate_text, load_model

    corpus = data.stdlib_corpus()
    model = load_model(out)
    sample = generate_text(model, prompt, max_new_tokens, temperature=0.8, top_k=20, seed=0)
    return {"metrics": checkpoint.read_metrics(out),
            "corpus": {"key": corpus.meta["key"], "python": corpus.meta["python"], "splits": corpus.meta["splits"]},
            "baselines": data.baselines(corpus), "prompt": prompt, "sample": sample,
            "torch_threads": torch.get_num_threads()}


def tiny_default() -> dict:
    """``k3course train`` (preset tiny, defaults) in a temporary folder, summarised by :func:`summarise_run`."""
    import tempfile

    from k3course import train
    from k3course.train.config import train_preset

    with tempfile.TemporaryDirectory() as folder:
        began = time.perf_counter()
        train.train(train.RunConfig(*train_preset("tiny")), Path(folder) / "run", progress=False)
        return {**summarise_run(Path(folder) / "run"), "train_seconds": time.perf_counter() - began}


SEEDS = (0, 1, 2)
# Five seeds where three left a verdict of chapter 12's rule within reach (|t| ≥ 2 and the 95% interval still
# holding 0): every variant of the 120-step hybrid-ratio, residuals, balancing and expert-count claims, and the two
# variants of each default-budget pair within reach (3:1 vs all-KDA, Full vs Block AttnRes, latent-wider vs full
# width; their claims' other variants stay at three). dense-baseline-default stays at three: at equal steps the
# tiny K3's lead (0.15 bits/byte) is outside the noise at three seeds already, and at equal time the mean
# difference (−0.003, s = 0.020) is so far inside it that two more seeds could not decide it.
FIVE_SEEDS = (0, 1, 2, 3, 4)
_TUNED = dict(seeds=SEEDS, lr_grid=tuning.LR_GRID)
_TEXT = dict(**_TUNED, task="text", train=dataclasses.asdict(claims.TEXT_TRAIN))
_TEXT5 = dict(_TEXT, seeds=FIVE_SEEDS)
_DEFAULT_TEXT = dict(**_TUNED, task="text", train=dataclasses.asdict(claims.DEFAULT_TEXT_TRAIN))
_TWO_MORE = (3, 4)
_MQAR = dict(**_TUNED, task="mqar", train=dataclasses.asdict(claims.MQAR_TRAIN))
EXPERIMENTS = {
    "tiny-default": (tiny_default, {}),
    "mqar-mixers": (mqar_mixers, MQAR_SETTINGS),
    "mqar-sweep": (mqar_sweep, MQAR_SWEEP),
    "mqar-controlled": (mqar_controlled, MQAR_CONTROLLED),
    "mqar-controlled-8": (mqar_controlled, MQAR_CONTROLLED_8),
    "dense-baseline": (claim_variants, {"claim": "dense-baseline", **_TEXT, "sample_prompt": "def "}),
    "dense-baseline-default": (claim_variants, {"claim": "dense-baseline", **_DEFAULT_TEXT,
                                                "equal_time": ("tiny K3", "dense Transformer")}),
    "hybrid-ratio": (claim_variants, {"claim": "hybrid-ratio", **_TEXT5}),
    "hybrid-mqar": (claim_variants, {"claim": "hybrid-ratio", **_MQAR}),
    "mqar-depth": (claim_variants, {"claim": "depth", **_MQAR}),
    "residuals": (claim_variants, {"claim": "residuals", **_TEXT5}),
    "balancing": (claim_variants, {"claim": "balancing", **_TEXT5}),
    "latent-moe": (claim_variants, {"claim": "latent-moe", **_TEXT}),
    "expert-count": (claim_variants, {"claim": "expert-count", **_TEXT5}),
    "hybrid-ratio-default": (claim_variants, {"claim": "hybrid-ratio", **_DEFAULT_TEXT, "more_seeds": {
        "variants": ("3:1", "all-KDA"), "seeds": _TWO_MORE}}),
    "residuals-default": (claim_variants, {"claim": "residuals", **_DEFAULT_TEXT, "more_seeds": {
        "variants": ("Block AttnRes", "Full AttnRes"), "seeds": _TWO_MORE}}),
    "latent-moe-default": (claim_variants, {"claim": "latent-moe", **_DEFAULT_TEXT, "more_seeds": {
        "variants": ("full width", "latent, wider experts"), "seeds": _TWO_MORE}}),
    "tuning-horizon": (tuning_horizon, {"claim_result": "latent-moe"}),
}


# --- budgets: where and how long the claims train ---------------------------------------------------------

BUDGETS = ("default", "gpu")
# The text claims on one GPU: 4× the default run's bytes per step (32 × 256; a model this small is bound by its
# kernel launches and host reads on a GPU, so the bigger batch comes nearly free) for 700 steps, 3.5× the bytes
# of the CPU budget: the four claims, tuning runs included, in about 1.8 GPU-hours on an H200 in one
# process, from the step times measured there (results/gpu_budget.json, :func:`gpu_budget_hours`).
GPU_TEXT_TRAIN = TrainConfig(steps=700, batch_size=32, seq_len=256, warmup_steps=50, eval_every=0,
                             eval_bytes=262144, checkpoint_every=0)
GPU_CLAIMS = ("dense-baseline-default", "hybrid-ratio-default", "residuals-default", "latent-moe-default")


def result_name(name: str, budget: str = "default") -> str:
    """The saved result's name: ``name``, or ``name-gpu`` for the GPU budget."""
    return name if budget == "default" else f"{name}-{budget}"


def budget_settings(name: str, budget: str = "default") -> dict:
    """Experiment ``name``'s settings under ``budget``: as saved for "default"; for "gpu" (the claims of
    :data:`GPU_CLAIMS` only) the training settings :data:`GPU_TEXT_TRAIN` on "cuda", every claim tuned alike."""
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {', '.join(BUDGETS)}, got {budget!r}")
    settings = EXPERIMENTS[name][1]
    if budget == "default":
        return settings
    if name not in GPU_CLAIMS:
        raise ValueError(f"budget: {name} has no GPU budget; the claims with one are {', '.join(GPU_CLAIMS)}")
    return {**settings, "train": dataclasses.asdict(GPU_TEXT_TRAIN), "device": "cuda", "lr_grid": tuning.LR_GRID}


def load(name: str) -> dict:
    """The saved result of experiment ``name``: {"command", "settings", "result", "seconds", "torch", "machine"}."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"name: no saved result for {name!r} at {path}; run `k3course experiments {name}`")
    return json.loads(path.read_text())


def gpu_step_ms() -> dict[str, dict[str, float]]:
    """{claim: {variant: ms per training step}} of the GPU budget as measured on an H200
    (``results/gpu_budget.json``: its batch shape, GPU and method are saved beside the numbers)."""
    return json.loads((RESULTS / "gpu_budget.json").read_text())["step_ms"]


def gpu_budget_hours(step_ms: dict[str, dict[str, float]], train: TrainConfig) -> float:
    """GPU-hours of every run of the :data:`GPU_CLAIMS` at ``train`` in one process: for every distinct variant
    config (a run trained by one claim is copied by the next), steps × its measured step time
    ``step_ms[claim][variant]`` × (its seeds + the tuning runs: grid size × :data:`tuning.TUNING_FRACTION`⁻¹), plus an
    equal-time claim's faster variant trained again for the slower one's time. A variant without a measurement
    takes the mean of its claim's measured ones. Evaluation (a few seconds per run) is left out."""
    seconds, counted = 0.0, set()
    for name in GPU_CLAIMS:
        settings, measured = budget_settings(name, "gpu"), step_ms[name]
        fallback = sum(measured.values()) / len(measured)
        variants = claims.CLAIMS[settings["claim"]]()
        seeds_of = variant_seeds(variants, settings["seeds"], settings.get("more_seeds"))
        for label, cfg in variants.items():
            per_step = measured.get(label, fallback) / 1e3
            if cfg not in counted:
                runs = len(seeds_of[label]) + len(settings.get("lr_grid", ())) / tuning.TUNING_FRACTION
                seconds += train.steps * per_step * runs
                counted.add(cfg)
            if label == settings.get("equal_time", (None,))[0]:
                seconds += train.steps * per_step * len(settings["seeds"])
    return seconds / 3600


def _checked_device(device: str) -> str:
    """``device`` as torch writes it, if it is a CPU or CUDA device (ValueError otherwise)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA torch device (cpu, cuda, cuda:1), got {device!r}")
    return str(parsed)


def run_experiment(name: str, jobs: int = 1, budget: str = "default", device: str | None = None) -> Path:
    """Run experiment ``name`` with its settings under ``budget`` (:func:`budget_settings`; claim experiments:
    ``jobs`` runs at a time, on ``device`` if given) and save the result as :func:`result_name`; returns the JSON
    file."""
    if name not in EXPERIMENTS:
        raise ValueError(f"name: unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    if not is_number(jobs) or jobs < 1:
        raise ValueError(f"jobs must be an int ≥ 1, got {jobs!r}")
    function, _ = EXPERIMENTS[name]
    settings = budget_settings(name, budget)
    if jobs > 1 and function is not claim_variants:
        raise ValueError(f"jobs: {name} runs in one process; --jobs applies to the claim experiments")
    if device is not None:
        if function is not claim_variants:
            raise ValueError(f"device: {name} trains on the CPU; --device applies to the claim experiments")
        settings = {**settings, "device": _checked_device(device)}
    cuda = on_cuda(settings.get("device", "cpu"))
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"budget: {budget!r} trains on a CUDA GPU and this machine has none")
    began = time.perf_counter()
    options = {"jobs": jobs} if function is claim_variants else {}
    outcome = function(**settings, **options)
    command = f"k3course experiments {name}" + (f" --budget {budget}" if budget != "default" else "")
    result = {"command": command, "settings": settings, "result": outcome, "seconds": time.perf_counter() - began,
              "torch": torch.__version__, "machine": machine(),
              **({"gpu": torch.cuda.get_device_name(settings["device"])} if cuda else {})}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{result_name(name, budget)}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3course experiments", description=__doc__.splitlines()[0])
    parser.add_argument("name", help=f"one of {', '.join(EXPERIMENTS)}")
    parser.add_argument("--jobs", type=int, default=1, help="claim experiments: runs trained at a time (processes)")
    parser.add_argument("--budget", choices=BUDGETS, default="default",
                        help=f"gpu: {', '.join(GPU_CLAIMS)} on a CUDA GPU at GPU_TEXT_TRAIN (about 1.8 GPU-hours for "
                             "all four), saved as NAME-gpu.json")
    parser.add_argument("--device", default=None, help="claim experiments: train on this torch device (default: "
                        "the budget's, cpu or cuda)")
    args = parser.parse_args(argv)
    try:
        path = run_experiment(args.name, args.jobs, args.budget, args.device)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"saved {path}")
    return 0
