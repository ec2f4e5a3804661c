"""Run folders as a tool: evaluate a checkpoint beside the n-gram baselines, compare the curves of several runs.

``k3course eval --checkpoint RUN [--data PATH ...]`` scores a run's model on its own validation split, or on
any text, in bits per byte, next to the byte n-grams fitted on the run's training bytes and lzma, all scored on
exactly the bytes the model predicts. ``k3course runs RUN RUN ...`` prints one row per run (model size, steps,
precision, data, last and best validation bits/byte, speed) and draws their validation curves in one PNG.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from k3course import accounting, checkpoint, data
from k3course.train import RunConfig
from k3course.train.config import DTYPES, read_saved_run, resolve_config, run_corpus
from k3course.train.generate import load_model
from k3course.train.step import LN2, evaluate


def evaluate_checkpoint(path: Path | str, paths=(), eval_bytes: int | None = None,
                        device: str = "cpu") -> dict:
    """``k3course eval``: bits/byte of the model of ``path`` (a checkpoint, or a run's latest) on the run's
    validation split, or on the text files ``paths`` names (files, folders, globs), beside the baselines.

    The bytes are ``eval_bytes`` (default: the run's ``train.eval_bytes``) in evenly spaced windows of the run's
    ``seq_len`` + 1, run at the run's precision. Baselines: add-0.1 byte n-grams fitted on the run's training
    bytes, and lzma -9, scored on the same bytes (:func:`k3course.data.window_baselines`). Returns {"checkpoint",
    "step", "source", "windows", "bytes", "bits_per_byte", "baselines"}.
    """
    folder = checkpoint.find_checkpoint(path)
    saved = read_saved_run(folder)
    config, corpus = saved.config, run_corpus(saved.config.run)
    if paths:
        tokens, n_files = data.text_bytes(paths)
        source = f"{n_files} file(s) of {', '.join(map(str, paths))}"
    else:
        tokens, source = corpus.val, "the run's validation split"
    if len(tokens) < config.train.seq_len + 1:
        raise ValueError(f"data: {source} holds {len(tokens)} bytes; the run's seq_len {config.train.seq_len} "
                         f"needs at least {config.train.seq_len + 1}")
    wanted = config.train.eval_bytes if eval_bytes is None else eval_bytes
    windows = data.eval_windows(tokens, config.train.seq_len, wanted)
    model = load_model(folder, device)
    loss = evaluate(model, windows, config.train.batch_size, DTYPES[config.run.dtype])
    return {"checkpoint": str(folder), "step": saved.step, "source": source,
            "windows": len(windows), "bytes": windows[:, 1:].numel(), "bits_per_byte": loss / LN2,
            "baselines": data.window_baselines(corpus.train, windows.numpy())}


def eval_report(result: dict) -> str:
    """The table ``k3course eval`` prints: the model's bits/byte, then each baseline's."""
    lines = [f"{result['checkpoint']} (step {result['step']}) on {result['bytes']:,} bytes of {result['source']} "
             f"({result['windows']} windows):",
             f"  {'model':<10}{result['bits_per_byte']:8.3f} bits/byte"]
    for name, value in result["baselines"].items():
        lines.append(f"  {name:<10}{value:8.3f}")
    lines.append("  (n-grams fitted on the run's training bytes; every row scores the same bytes)")
    return "\n".join(lines)


# --- comparing runs --------------------------------------------------------------------------------------

def run_config(out: Path | str) -> RunConfig:
    """A run folder's whole configuration: its config.toml, or (a run from before config.toml) its latest
    checkpoint's."""
    written = Path(out) / "config.toml"
    if written.exists():
        return resolve_config(config_file=written)
    return read_saved_run(checkpoint.find_checkpoint(out)).config


def run_summary(out: Path | str) -> dict:
    """One row of ``k3course runs``: a run folder's model, progress, data and numbers (from metrics.jsonl)."""
    records = checkpoint.read_metrics(out)
    if not records:
        raise FileNotFoundError(f"runs: {out} has no metrics.jsonl records (not a k3course run folder)")
    config = run_config(out)
    counts = accounting.param_count(config.model)
    evals = [r["val_bpb"] for r in records if "val_bpb" in r]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return {"run": str(out), "model": config.model.name, "params": counts.total, "active": counts.active,
            "step": records[-1]["step"], "steps": config.train.steps, "dtype": config.run.dtype,
            "data": f"{len(config.run.data)} path(s)" if config.run.data else "stdlib",
            "train_bpb": records[-1]["loss"] / LN2, "val_bpb": evals[-1] if evals else None,
            "best_val_bpb": min(evals) if evals else None,
            "tokens_per_s": statistics.median(speeds) if speeds else None}


def _cell(value, spec: str, unit: str = "") -> str:
    return "—" if value is None else format(value, spec) + unit


def runs_table(rows: list[dict]) -> str:
    """The rows of :func:`run_summary` as an aligned text table (— where a run has no such number)."""
    columns = {"run": lambda r: r["run"], "model": lambda r: r["model"],
               "params": lambda r: _cell(r["params"] / 1e6, ".2f", "M"),
               "active": lambda r: _cell(r["active"] / 1e6, ".2f", "M"),
               "step": lambda r: f"{r['step']}/{r['steps']}", "dtype": lambda r: r["dtype"],
               "data": lambda r: r["data"], "train bpb": lambda r: _cell(r["train_bpb"], ".3f"),
               "val bpb": lambda r: _cell(r["val_bpb"], ".3f"), "best val": lambda r: _cell(r["best_val_bpb"], ".3f"),
               "tok/s": lambda r: _cell(r["tokens_per_s"], ".0f")}
    cells = [list(columns)] + [[cell(row) for cell in columns.values()] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(value.ljust(width) for value, width in zip(line, widths)).rstrip() for line in cells)


def plot_runs(outs: list[Path | str], path: Path | str) -> Path:
    """One PNG at ``path``: the validation bits/byte of every run against step (training bits/byte faint)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for index, out in enumerate(outs):
        records, color = checkpoint.read_metrics(out), f"C{index % 10}"
        axes.plot([r["step"] for r in records], [r["loss"] / LN2 for r in records], color=color, lw=0.6,
                  alpha=0.35)
        evals = [r for r in records if "val_bpb" in r]
        axes.plot([r["step"] for r in evals], [r["val_bpb"] for r in evals], "o-", color=color, ms=3,
                  label=f"{out} (validation)" if evals else f"{out} (training only)")
    axes.set(xlabel="optimizer step", ylabel="bits per byte", title="validation (markers) and training (faint)")
    axes.legend(fontsize=8)
    path = Path(path)
    figure.savefig(path, dpi=100)
    return path


def compare_runs(outs: list[Path | str], plot: Path | str = "runs.png") -> tuple[list[dict], Path]:
    """``k3course runs``: the summary row of every run folder in ``outs`` and the PNG of their curves."""
    if not outs:
        raise ValueError("runs: name at least one run folder")
    rows = [run_summary(out) for out in outs]
    return rows, plot_runs(outs, plot)
