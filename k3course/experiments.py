"""``k3course experiments NAME``: the runs behind chapter 12's claims, saved as JSON inside the package.

Each experiment is a function of its settings that returns plain data; :func:`main` runs one and writes
``k3course/results/NAME.json`` with the command that made it, its settings and every run's per-step losses,
so a saved number can be regenerated (``k3course experiments NAME``) and checked (a test replays the first
steps of a saved run and must get the saved losses exactly on the machine that made them, and to float32
rounding on a CPU whose kernels sum in another order; the saved ``machine`` says which).

tiny-default  ``k3course train`` with its defaults (the tiny K3, 800 steps on the stdlib bytes): per-step metrics,
              validation bits/byte against the n-gram and lzma baselines of the same split, a generated sample.
mqar-mixers   KDA vs Gated DeltaNet vs decayed linear attention on harder MQAR (40 pairs in 32-dimensional
              heads: more pairs than a head's state has dimensions), the same small recall model around each.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from k3course.attention.recall import MIXERS, RecallModel, recall_accuracy
from k3course.data import HARD_MQAR, IGNORE, mqar
from k3course.train import lr_factor

RESULTS = Path(__file__).parent / "results"
MQAR_SETTINGS = dict(steps=400, batch_size=32, lr=3e-3, warmup_steps=40, d_model=64, n_heads=2, seeds=(0, 1, 2))


def recall_run(mixer: str, seed: int, steps: int, batch_size: int, lr: float, warmup_steps: int, d_model: int,
               n_heads: int, stop_after: int | None = None) -> dict:
    """Train a :class:`RecallModel` with ``mixer`` on harder MQAR; {"losses", "accuracy", "seconds"}.

    AdamW (no weight decay) at lr · f(step), f = :func:`k3course.train.lr_factor` (warmup, cosine to 0.1);
    batch ``step`` is ``mqar(..., seed=seed·10⁶ + step)``; accuracy on 256 held-out sequences (seed 10⁹ + seed).
    ``stop_after`` ends the run early without changing any earlier step (for replaying a saved run).
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = RecallModel(HARD_MQAR["vocab_size"], mixer, d_model=d_model, n_heads=n_heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    factor = functools.partial(lr_factor, warmup_steps=warmup_steps, total_steps=steps, min_lr_ratio=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    losses, began = [], time.perf_counter()
    for step in range(steps if stop_after is None else stop_after):
        tokens, targets = mqar(batch_size, seed=seed * 10**6 + step, **HARD_MQAR)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    held_out = mqar(256, seed=10**9 + seed, **HARD_MQAR)
    return {"losses": losses, "accuracy": recall_accuracy(model, *held_out), "seconds": time.perf_counter() - began}


def mqar_mixers(steps: int, batch_size: int, lr: float, warmup_steps: int, d_model: int, n_heads: int,
                seeds: tuple[int, ...]) -> list[dict]:
    """Every mixer of :data:`k3course.attention.recall.MIXERS` × every seed: [{"mixer", "seed", ...run}, ...]."""
    return [{"mixer": mixer, "seed": seed,
             **recall_run(mixer, seed, steps, batch_size, lr, warmup_steps, d_model, n_heads)}
            for mixer in MIXERS for seed in seeds]


def summarise_run(out: Path, prompt: str = "def ", max_new_tokens: int = 300) -> dict:
    """What a finished ``k3course train`` run in ``out`` shows: its metrics, the corpus it read, the baselines of
    that corpus, and a sample from its last checkpoint (temperature 0.8, top-k 20, seed 0)."""
    from k3course import data, train

    corpus = data.stdlib_corpus()
    model = train.load_model(out)
    sample = train.generate_text(model, prompt, max_new_tokens, temperature=0.8, top_k=20, seed=0)
    return {"metrics": train._Metrics.read(out), "corpus": {"key": corpus.meta["key"], "python": corpus.meta["python"],
            "splits": corpus.meta["splits"]}, "baselines": data.baselines(corpus), "prompt": prompt, "sample": sample,
            "torch_threads": torch.get_num_threads()}


def tiny_default() -> dict:
    """``k3course train`` (preset tiny, defaults) in a temporary folder, summarised by :func:`summarise_run`."""
    import tempfile

    from k3course import train

    with tempfile.TemporaryDirectory() as folder:
        began = time.perf_counter()
        train.train_command("tiny", out=Path(folder) / "run", progress=False)
        return {**summarise_run(Path(folder) / "run"), "train_seconds": time.perf_counter() - began}


EXPERIMENTS = {"tiny-default": (tiny_default, {}), "mqar-mixers": (mqar_mixers, MQAR_SETTINGS)}


def machine() -> str:
    """The CPU and the kernel set ATen dispatches to, e.g. "AMD EPYC / AVX2": float sums depend on both."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return f"{names[0] if names else platform.processor() or platform.machine()} / " \
           f"{torch.backends.cpu.get_cpu_capability()}"


def load(name: str) -> dict:
    """The saved result of experiment ``name``: {"command", "settings", "result", "seconds", "torch", "machine"}."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"name: no saved result for {name!r} at {path}; run `k3course experiments {name}`")
    return json.loads(path.read_text())


def run_experiment(name: str) -> Path:
    """Run experiment ``name`` with its settings and save the result; returns the JSON file."""
    if name not in EXPERIMENTS:
        raise ValueError(f"name: unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    function, settings = EXPERIMENTS[name]
    began = time.perf_counter()
    result = {"command": f"k3course experiments {name}", "settings": settings, "result": function(**settings),
              "seconds": time.perf_counter() - began, "torch": torch.__version__, "machine": machine()}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3course experiments", description=__doc__.splitlines()[0])
    parser.add_argument("name", help=f"one of {', '.join(EXPERIMENTS)}")
    args = parser.parse_args(argv)
    try:
        path = run_experiment(args.name)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"saved {path}")
    return 0
