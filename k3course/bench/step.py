"""bench step: where one training step (forward + backward + AdamW + the MoE bias update) spends its time, by
component, for a K3 preset and for the dense Transformer of equal active parameters beside it.

Method — one clock, cut into rows. The step runs ``--repeats`` times under ``torch.profiler``; hooks open a named
range around each part of the model (embedding, every mixer, norm and FFN, each decoder layer, the LM head, the
model as a whole), the MoE layers open their own stage ranges (``moe.route`` …), and the step names the
optimizer and the bias update. Every microsecond of the step is given to exactly one row:

    forward    the innermost range open at that instant (a layer's own time, outside its mixer, norms and FFN,
               is its residual reads and writes; the model's own time is the final read and the loss)
    backward   the range whose forward created the autograd node being run (the profiler's sequence numbers)
    neither    "other": Python between the parts, autograd's engine between nodes, zeroing the gradients

so the rows add up to the profiled step exactly and none is negative. The profiler's own cost is reported: the
profiled step beside the same step timed without it (best of ``--repeats`` steps in each of ``--rounds`` rounds in
which K3 and the dense model take turns, which also gives their ratio).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from k3course.baselines import dense_transformer
from k3course.bench import BACKWARD_EVENT, add_options, apply_options, profile_calls
from k3course.config import K3Config
from k3course.device import interleaved_best_seconds
from k3course.model import K3Model

STEP, OTHER = "step", "other"
MOE_STAGE = "moe."  # prefix of the ranges MoE.forward opens


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench step", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], help="K3Config presets to time")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--no-dense", action="store_true", help="leave out the dense Transformer of equal active size")
    parser.add_argument("--plot", default=None, help="save a stacked bar of the breakdown to this PNG")
    add_options(parser, threads=0, repeats=3, rounds=3)
    args = parser.parse_args(options)
    for name in ("batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    return args


# --- naming the parts: ranges opened by forward hooks -------------------------------------------------------

@contextmanager
def named_parts(labels: dict[nn.Module, str]):
    """While open, each module of ``labels`` runs inside a profiler range named by its label (a forward pre-hook
    opens it, the forward hook closes it), so nested modules give nested ranges."""
    open_ranges: list = []

    def enter(module, args, label):
        open_ranges.append(torch.profiler.record_function(label))
        open_ranges[-1].__enter__()

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    hooks = []
    for module, label in labels.items():
        hooks.append(module.register_forward_pre_hook(lambda m, a, label=label: enter(m, a, label)))
        hooks.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def model_labels(model: K3Model) -> dict[nn.Module, str]:
    """The rows of a K3Model: {module: label}, the modules its forward calls."""
    labels = {model: "final read + loss", model.embed: "embedding", model.final_norm: "RMSNorms"}
    if model.lm_head is not None:
        labels[model.lm_head] = "LM head"
    for layer in model.layers:
        labels[layer] = "residual reads + writes"
        labels[layer.mixer_norm] = labels[layer.ffn_norm] = "RMSNorms"
        labels[layer.mixer] = f"{layer.mixer_kind.upper()} mixers"
        labels[layer.ffn] = "dense FFN" if layer.ffn_kind == "dense" else "MoE (outside its stages)"
    return labels


# --- cutting the clock ---------------------------------------------------------------------------------------

def _row_of_range(name: str, labels: set[str]) -> str | None:
    """The row a profiler range belongs to: a part's label, a MoE stage ("moe.route" -> "MoE route"), or None."""
    if name in labels:
        return name
    if name.startswith(MOE_STAGE):
        return "MoE " + name[len(MOE_STAGE):]
    return None


def _owner(event, labels: set[str]) -> str:
    """The row of the innermost range around a forward op (OTHER outside every range)."""
    parent = event.cpu_parent
    while parent is not None:
        row = _row_of_range(parent.name, labels)
        if row is not None:
            return row
        parent = parent.cpu_parent
    return OTHER


def attribute(events: list, labels: set[str]) -> list[dict[str, float]]:
    """Seconds per row of each profiled step, in order (see the module docstring): each range's and each backward
    node's exclusive time (its span minus the spans of the ranges and nodes directly inside it) goes to its row,
    the step range's own exclusive time to OTHER. ``labels``: the part labels the hooks used (plus "optimizer"
    and "MoE bias update", which the step opens)."""
    owner_of_node = {}  # autograd sequence number -> row of the forward op that made the node
    for event in events:
        if event.sequence_nr >= 0 and not event.name.startswith(BACKWARD_EVENT):
            owner_of_node.setdefault(event.sequence_nr, _owner(event, labels))

    def row_of(event) -> str | None:
        if event.name == STEP:
            return OTHER
        if event.name.startswith(BACKWARD_EVENT):
            return owner_of_node.get(event.sequence_nr, OTHER)
        return _row_of_range(event.name, labels)

    def visit(event, row: str, rows: dict[str, float]) -> None:
        """Give ``event``'s span to ``row``, less the spans of the row-carrying events directly inside it."""
        inner = [(child, row_of(child)) for child in _row_carrying_children(event, row_of)]
        own = event.time_range.elapsed_us() - sum(child.time_range.elapsed_us() for child, _ in inner)
        rows[row] = rows.get(row, 0.0) + max(own, 0.0) / 1e6
        for child, child_row in inner:
            visit(child, child_row, rows)

    steps = sorted((e for e in events if e.name == STEP and e.cpu_parent is None), key=lambda e: e.time_range.start)
    per_step = []
    for event in steps:
        per_step.append({})
        visit(event, OTHER, per_step[-1])
    return per_step


def _row_carrying_children(event, row_of: Callable) -> list:
    """The nearest descendants of ``event`` that carry a row (looking through ops that do not)."""
    found = []
    for child in event.cpu_children:
        if row_of(child) is not None:
            found.append(child)
        else:
            found.extend(_row_carrying_children(child, row_of))
    return found


# --- a training step, profiled -------------------------------------------------------------------------------

def training_step(model: K3Model, tokens: torch.Tensor) -> Callable[[], None]:
    """One AdamW step as ``k3course train`` runs it (forward with targets, backward, step, bias update), each
    call inside a range named STEP; the optimizer and the bias update in ranges of their own."""
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        with torch.profiler.record_function(STEP):
            optimizer.zero_grad(set_to_none=True)
            model(inputs, targets=targets)[1].backward()
            with torch.profiler.record_function("optimizer"):
                optimizer.step()
            with torch.profiler.record_function("MoE bias update"):
                for moe in model.moe_layers():
                    moe.update_bias()
    return step


def profile_step(step: Callable[[], None], labels: dict[nn.Module, str], repeats: int) -> dict:
    """{"profiled": seconds of the fastest of ``repeats`` profiled steps, "rows": {row: seconds} of that step
    (they add up to it)}: the fastest, the one least disturbed by other processes."""
    with named_parts(labels):
        events, _ = profile_calls(step, repeats)
    per_step = attribute(events, set(labels.values()) | {"optimizer", "MoE bias update"})
    rows = min(per_step, key=lambda rows: sum(rows.values()))
    return {"profiled": sum(rows.values()), "rows": rows}


def breakdown(configs: dict[str, K3Config], batch: int, seq: int, repeats: int, rounds: int = 1) -> dict:
    """{name: {"step": seconds unprofiled, "profiled": ..., "rows": ...}} for a K3Model of each config on the
    same seeded random tokens [batch, seq + 1]. The unprofiled steps are timed in ``rounds`` rounds in which the
    models take turns (a busy spell of a shared machine slows all of them alike), the best of ``repeats`` steps
    per round; then each model's steps are profiled (:func:`profile_step`, the fastest of ``rounds`` tries). Two
    warm-up steps each first."""
    steps = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        model = K3Model.from_config(cfg).train()
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
        steps[name] = (training_step(model, tokens), model_labels(model))
        for _ in range(2):
            steps[name][0]()
    best = interleaved_best_seconds({name: (step, repeats) for name, (step, _) in steps.items()}, rounds)
    profiled = {name: min((profile_step(step, labels, repeats) for _ in range(rounds)), key=lambda r: r["profiled"])
                for name, (step, labels) in steps.items()}
    return {name: {"step": best[name], **profiled[name]} for name in steps}


# --- report --------------------------------------------------------------------------------------------------

def report(name: str, result: dict, tokens: int) -> str:
    """The table of one model: rows in ms and as shares of the profiled step, which they add up to."""
    rows, profiled = result["rows"], result["profiled"]
    lines = [f"{name}: {result['step'] * 1e3:.1f} ms per step unprofiled, {tokens / result['step']:,.0f} tokens/s; "
             f"profiled {profiled * 1e3:.1f} ms (the profiler's cost: {profiled / result['step'] - 1:+.0%})"]
    for row, seconds in sorted(rows.items(), key=lambda item: -item[1]):
        lines.append(f"  {row:<28} {seconds * 1e3:9.1f} ms  {seconds / profiled:6.1%}")
    lines.append(f"  {'sum of the rows':<28} {sum(rows.values()) * 1e3:9.1f} ms  {sum(rows.values()) / profiled:6.1%}")
    return "\n".join(lines)


def _plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({row for result in results.values() for row in result["rows"]})
    fig, ax = plt.subplots(figsize=(1.6 * len(results) + 4, 4.5))
    for column, result in enumerate(results.values()):
        bottom = 0.0
        for index, row in enumerate(names):
            milliseconds = result["rows"].get(row, 0.0) * 1e3
            ax.bar(column, milliseconds, bottom=bottom, color=plt.cm.tab20(index % 20),
                   label=row if column == 0 else None)
            bottom += milliseconds
    ax.set_xticks(range(len(results)), list(results), fontsize=8)
    ax.set_ylabel("ms per training step (profiled)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(options: list[str]) -> int:
    args = _options(options)
    print(f"settings: {apply_options(args.threads, args.return_freed_memory)}; {torch.get_num_threads()} thread(s)")
    results = {}
    for preset in args.presets:
        cfg = K3Config.preset(preset)
        configs = {preset: cfg} if args.no_dense else {preset: cfg, f"dense ({preset})": dense_transformer(cfg)}
        start = time.perf_counter()
        results |= breakdown(configs, args.batch, args.seq, args.repeats, args.rounds)
        for name in configs:
            print(report(name, results[name], args.batch * args.seq))
        if not args.no_dense:
            ratio = results[preset]["step"] / results[f"dense ({preset})"]["step"]
            print(f"{preset} / dense of equal active parameters: {ratio:.2f}x per training step (unprofiled, "
                  f"{args.rounds} interleaved rounds; took {time.perf_counter() - start:.0f} s)")
    if args.plot:
        _plot(results, args.plot)
        print(f"plot saved to {args.plot}")
    return 0
