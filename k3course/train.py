"""Training K3 on the stdlib bytes: AdamW, warmup + cosine, clipping, accumulation, MoE balancing, exact resume.

One optimizer step:

    for each of the A micro-batches (inputs, targets) [B, T]:   loss_j = model(inputs, targets)   (nats/byte)
        backward(loss_j / A)                                    gradients of the mean over A·B·T bytes
    clip ‖g‖₂ to grad_clip;  AdamW step at lr(step);  zero the gradients
    for each MoE layer: read its routing statistics, then update_bias()   (all A micro-batches since the last)

The learning rate is lr · f(step) with a linear warmup and a cosine decay to ``min_lr_ratio · lr``:

    f(s) = (s + 1) / W                                          s < W
    f(s) = r + (1 − r) · ½ (1 + cos(π (s − W) / (S − W)))       W ≤ s < S        (r = min_lr_ratio)

Micro-batch j of step s is window batch number s·A + j of the seeded stream (:func:`k3course.data.batch_at`),
so the data position is a function of the step: a run resumed from a checkpoint (weights, optimizer,
scheduler, RNG, step) continues exactly as if it had never stopped. Bits per byte = loss / ln 2.

The same step runs on P ranks when the model's experts are expert-parallel
(:func:`k3course.distributed.parallelize_experts`): each rank reads its 1/P of every micro-batch, and the
gradients are averaged over the ranks and clipped by the norm of the whole gradient
(:mod:`k3course.distributed.data_parallel`), so the step is the one-process step on the concatenated batch.
``k3course train --ep P`` spawns P local ranks; ``python -m k3course.train`` is one rank under torchrun.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from k3course import checkpoint, data, distributed
from k3course.config import K3Config
from k3course.debug import progress_bar

LN2 = math.log(2)


@dataclass(frozen=True)
class TrainConfig:
    """How to train: ``steps`` optimizer steps of ``grad_accum`` micro-batches of ``batch_size × seq_len`` bytes.

    Evaluation every ``eval_every`` steps on ``eval_bytes`` validation bytes (and at the end); a checkpoint
    every ``checkpoint_every`` steps (and at the end); 0 turns either off (except at the end).
    """

    steps: int = 800
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_bytes: int = 131072
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
        for name in ("warmup_steps", "eval_every", "eval_bytes", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int ≥ 0, got {value!r}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or not self.grad_clip > 0:
            raise ValueError(f"lr > 0, min_lr_ratio in [0, 1] and grad_clip > 0 are required, got lr={self.lr}, "
                             f"min_lr_ratio={self.min_lr_ratio}, grad_clip={self.grad_clip}")

    @property
    def tokens_per_step(self) -> int:
        return self.grad_accum * self.batch_size * self.seq_len

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)


# The training presets: a model preset (:meth:`K3Config.preset`) and how to train it. "tiny" is the default run,
# sized for ≤ 10 minutes on 2 CPU cores; "small" is sized for one GPU.
TRAIN_PRESETS: dict[str, tuple[str, TrainConfig]] = {
    "tiny": ("tiny", TrainConfig()),
    "small": ("small", TrainConfig(steps=5000, batch_size=32, seq_len=512, lr=2e-3, warmup_steps=200,
                                   eval_every=500, eval_bytes=1 << 20, checkpoint_every=1000)),
}


def train_preset(name: str) -> tuple[K3Config, TrainConfig]:
    """(model config, training config) of a training preset (one of :data:`TRAIN_PRESETS`)."""
    if name not in TRAIN_PRESETS:
        raise ValueError(f"name: unknown training preset {name!r}; choose one of {', '.join(TRAIN_PRESETS)}")
    model_preset, train_config = TRAIN_PRESETS[name]
    return K3Config.preset(model_preset), train_config


# --- schedule, step, evaluation ------------------------------------------------------------------------

def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """f(step): linear warmup over ``warmup_steps``, then cosine from 1 down to ``min_lr_ratio`` at the end."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, train: TrainConfig) -> tuple[torch.optim.Optimizer, object]:
    """AdamW over ``model.param_groups(weight_decay)`` and its warmup + cosine LambdaLR scheduler."""
    optimizer = torch.optim.AdamW(model.param_groups(train.weight_decay), lr=train.lr, betas=train.betas)
    factor = functools.partial(lr_factor, warmup_steps=train.warmup_steps, total_steps=train.steps,
                               min_lr_ratio=train.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def balance_experts(model: torch.nn.Module) -> dict:
    """Routing statistics of every MoE layer over the micro-batches since the last call, then ``update_bias()``
    (with expert-parallel experts both pool all ranks' routing: collectives).

    Returns {"max_violation": the worst layer's max_j load_j / mean load − 1, "max_violation_per_layer": [...]}.
    """
    per_layer = []
    for moe in model.moe_layers():
        per_layer.append(float(moe.load_statistics()["max_violation"]))
        moe.update_bias()
    return {"max_violation": max(per_layer, default=0.0), "max_violation_per_layer": per_layer}


def train_step(model: torch.nn.Module, optimizer, scheduler, micro_batches, grad_clip: float) -> dict:
    """One optimizer step over ``micro_batches`` [(inputs [B, T], targets [B, T]), ...]; see the module docstring.

    With expert-parallel experts every rank calls it together with its own shard of each micro-batch: the
    gradients are then averaged over the ranks and clipped by the global norm, the loss averaged over the
    ranks, and the balancing statistics pooled, so every rank gets the one-process numbers of the whole batch.
    Returns {"loss": mean micro-batch loss, "lr": the rate this step used, "grad_norm": ‖g‖₂ before clipping,
    "max_violation", "max_violation_per_layer"}.
    """
    model.train()
    total = torch.zeros((), dtype=torch.float64)  # the reported loss is summed in float64
    for inputs, targets in micro_batches:
        _, loss, _ = model(inputs, targets=targets)
        (loss / len(micro_batches)).backward()
        total += loss.detach().double().cpu()
    if distributed.expert_parallel_layers(model):  # P ranks: everything but the routed experts is data-parallel
        distributed.average_gradients(model)
        grad_norm = distributed.clip_global_grad_norm(model, grad_clip)
        total = distributed.average_over_ranks(total, model)
    else:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total.item() / len(micro_batches), "lr": lr, "grad_norm": grad_norm, **balance_experts(model)}


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-byte cross-entropy (nats per byte) over ``windows`` [N, T + 1], in eval mode (bias frozen).

    Computed from the logits, so auxiliary balancing losses never enter a validation number.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        logits, _, _ = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train(was_training)
    return total / count


# --- a whole run ---------------------------------------------------------------------------------------

def _check_out(out: Path, resume: bool) -> Path | None:
    """Validate ``out``; return the checkpoint to resume from (None for a fresh run)."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out: {out} is a file, not a folder for checkpoints")
    latest = checkpoint.latest_checkpoint(out)
    if resume and latest is None:
        raise FileNotFoundError(f"out: no checkpoint to resume in {out}")
    if not resume and latest is not None:
        raise FileExistsError(f"out: {out} already holds checkpoints ({latest.name}); resume or use another out")
    return latest if resume else None


def saved_train_config(folder: Path) -> TrainConfig:
    """The TrainConfig a checkpoint was trained with (JSON lists back to tuples)."""
    saved = checkpoint.read_config(folder)["train"]
    try:
        return TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    except (TypeError, ValueError) as error:
        message = f"checkpoint: {folder}/config.json has no valid train settings: {error}"
        raise checkpoint.CheckpointError(message) from error


def _check_resume(folder: Path, model_config: K3Config, train: TrainConfig) -> None:
    saved_model = checkpoint.read_config(folder)["model"]
    if saved_model != model_config:
        raise checkpoint.CheckpointError(f"checkpoint: {folder} holds another model ({saved_model.name})")
    saved_train = saved_train_config(folder)
    differ = [f.name for f in dataclasses.fields(train) if getattr(train, f.name) != getattr(saved_train, f.name)]
    if differ:
        raise ValueError(f"train: resuming needs the run's own settings; these differ from {folder}: "
                         + ", ".join(f"{name}={getattr(saved_train, name)!r}" for name in differ))


def build_model(model_config: K3Config, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A freshly initialised K3Model, seeded (same seed, same weights)."""
    from k3course.model import K3Model

    torch.manual_seed(seed)
    return K3Model.from_config(model_config, device=device)


def _micro_batches(tokens, step: int, train: TrainConfig, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    first = step * train.grad_accum
    batches = [data.batch_at(tokens, first + j, train.batch_size, train.seq_len, train.seed)
               for j in range(train.grad_accum)]
    return [(inputs.to(device), targets.to(device)) for inputs, targets in batches]


def rank_shards(micro_batches, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s 1/P of the rows of every micro-batch [(inputs [B, T], targets [B, T]), ...]."""
    return [(inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]) for inputs, targets in micro_batches]


class _Metrics:
    """metrics.jsonl in ``out``: one JSON object per line; on resume, lines after the checkpoint are dropped."""

    def __init__(self, out: Path, keep_until: int):
        self.path = out / "metrics.jsonl"
        kept = [r for r in self.read(out) if r["step"] <= keep_until] if keep_until else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    @staticmethod
    def read(out: Path) -> list[dict]:
        path = Path(out) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def write(self, record: dict) -> None:
        with self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")


def plot_losses(out: Path, baselines: dict[str, float] | None = None) -> Path:
    """loss.png in ``out``: training and validation bits/byte against step, n-gram baselines as lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = _Metrics.read(out)
    figure = Figure(figsize=(7, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    steps = [r["step"] for r in records if "loss" in r]
    axes.plot(steps, [r["loss"] / LN2 for r in records if "loss" in r], lw=0.8, label="train (incl. aux)")
    evals = [r for r in records if "val_bpb" in r]
    axes.plot([r["step"] for r in evals], [r["val_bpb"] for r in evals], "o-", label="validation")
    for (name, value), style in zip((baselines or {}).items(), (":", "--", "-.", (0, (1, 4)))):
        axes.axhline(value, color="gray", ls=style, lw=1, label=name)
    axes.set(xlabel="optimizer step", ylabel="bits per byte", ylim=(0, 8))
    axes.legend(fontsize=8)
    path = Path(out) / "loss.png"
    figure.savefig(path, dpi=100)
    return path


def run(model_config: K3Config, train: TrainConfig, out: Path | str, resume: bool = False,
        corpus: data.ByteCorpus | None = None, device: torch.device | str = "cpu", progress: bool = True,
        model_factory: Callable[[K3Config, int, object], torch.nn.Module] = build_model) -> torch.nn.Module:
    """Train (or resume) a run in ``out``: metrics.jsonl, loss.png and step-NNNNNN/ checkpoints. Returns the model.

    ``resume=True`` continues from the latest checkpoint in ``out`` up to ``train.steps`` (the run's settings
    must match the saved ones); ``resume=False`` refuses an ``out`` that already holds checkpoints.
    """
    out = Path(out)
    start_from = _check_out(out, resume)
    if start_from is not None:
        _check_resume(start_from, model_config, train)
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus or data.stdlib_corpus()
    model = model_factory(model_config, train.seed, device)
    optimizer, scheduler = make_optimizer(model, train)
    step = 0
    if start_from is not None:
        checkpoint.load_weights(start_from, model)
        step = checkpoint.load_state(start_from, optimizer, scheduler)
    metrics = _Metrics(out, keep_until=step)
    windows = data.eval_windows(corpus.val, train.seq_len, train.eval_bytes)
    config = {"model": dataclasses.asdict(model_config), "train": dataclasses.asdict(train)}
    bar = progress_bar(total=train.steps, initial=step, disable=not progress, desc="train", unit="step")
    while step < train.steps:
        began = time.perf_counter()
        record = train_step(model, optimizer, scheduler, _micro_batches(corpus.train, step, train, device),
                            train.grad_clip)
        step += 1
        record = {"step": step, **record, "tokens_per_s": train.tokens_per_step / (time.perf_counter() - began)}
        if step == train.steps or (train.eval_every and step % train.eval_every == 0):
            record["val_loss"] = evaluate(model, windows, train.batch_size)
            record["val_bpb"] = record["val_loss"] / LN2
        metrics.write(record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                        max_viol=f"{record['max_violation']:.2f}", **({"val_bpb": f"{record['val_bpb']:.3f}"}
                                                                       if "val_bpb" in record else {}))
        if step == train.steps or (train.checkpoint_every and step % train.checkpoint_every == 0):
            checkpoint.save_checkpoint(out, step, model, optimizer, scheduler, config)
    bar.close()
    plot_losses(out, data.baselines(corpus))
    return model


# --- generation ----------------------------------------------------------------------------------------

def load_model(path: Path | str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model of a checkpoint folder, or of the latest checkpoint of a run folder, in eval mode."""
    path = Path(path)
    if not path.is_dir():
        raise checkpoint.CheckpointError(f"checkpoint: no folder at {path}")
    folder = path if (path / "config.json").exists() else checkpoint.latest_checkpoint(path)
    if folder is None:
        raise checkpoint.CheckpointError(f"checkpoint: {path} holds no checkpoint (step-NNNNNN folders)")
    config = checkpoint.read_config(folder)
    from k3course.model import K3Model

    model = K3Model.from_config(config["model"], device=device)
    checkpoint.load_weights(folder, model)
    return model.eval()


def generate_text(model: torch.nn.Module, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = None, seed: int = 0) -> str:
    """The prompt continued byte by byte; bytes that are not valid UTF-8 are shown as U+FFFD."""
    try:
        prompt_bytes = prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"prompt: not valid UTF-8 text ({error.reason} at position {error.start})") from error
    if not prompt_bytes:
        raise ValueError("prompt: must not be empty (the model needs at least one byte to continue)")
    device = next(model.parameters()).device
    tokens = torch.tensor([list(prompt_bytes)], dtype=torch.int64, device=device)
    generated = model.generate(tokens, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return bytes(generated[0].tolist()).decode("utf-8", errors="replace")


# --- the command line (k3course train / generate) ------------------------------------------------------

def train_command(preset_name: str = "tiny", steps: int | None = None, out: Path | str | None = None,
                  resume: bool = False, device: str = "cpu", progress: bool = True) -> dict:
    """``k3course train``: the preset's run in ``out`` (default ``runs/<preset>``); returns a summary dict.

    ``steps`` is the run's total number of optimizer steps. With ``resume`` the run's saved settings are used
    (``steps``, if given, must be the saved total: a different total would change the cosine schedule).
    """
    model_config, train_config = train_preset(preset_name)
    out = Path(out) if out is not None else Path("runs") / preset_name
    if resume:
        train_config = saved_train_config(_check_out(out, resume=True))
    if steps is not None:
        train_config = train_config.replace(steps=steps)
    began = time.perf_counter()
    run(model_config, train_config, out, resume, device=device, progress=progress)
    final = _Metrics.read(out)[-1]
    return {"out": str(out), "step": final["step"], "val_bpb": final["val_bpb"], "seconds": time.perf_counter() - began,
            "baselines": data.baselines(data.stdlib_corpus())}


def generate_command(checkpoint_path: Path | str, prompt: str, max_new_tokens: int = 200,
                     temperature: float = 0.8, top_k: int | None = None, seed: int = 0) -> str:
    """``k3course generate``: the prompt continued by the model of a checkpoint (or a run's latest)."""
    model = load_model(checkpoint_path)
    return generate_text(model, prompt, max_new_tokens, temperature, top_k, seed)


# --- expert-parallel runs (k3course train --ep P, torchrun) --------------------------------------------

def train_ranks(rank: int, world_size: int, preset_name: str, steps: int | None, out: str,
                device: torch.device | str = "cpu") -> list[dict]:
    """One rank of an expert-parallel run of the preset: :func:`train_step` with the MoE layers' experts spread
    over the ranks, each rank reading its 1/P of every micro-batch of the one-process run. Rank 0 writes
    metrics.jsonl after every step and, at the end, one single-process checkpoint (weights and optimizer
    gathered) that ``k3course generate`` and a one-process ``--resume`` can load. Returns the per-step records."""
    model_config, train_config = train_preset(preset_name)
    if steps is not None:
        train_config = train_config.replace(steps=steps)
    if train_config.batch_size % world_size:
        raise ValueError(f"--ep {world_size} must divide the preset's batch_size {train_config.batch_size}")
    corpus = data.stdlib_corpus()
    model = distributed.parallelize_experts(build_model(model_config, train_config.seed, device))
    optimizer, scheduler = make_optimizer(model, train_config)
    out = Path(out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        metrics = _Metrics(out, keep_until=0)
    records = []
    for step in range(train_config.steps):
        shards = rank_shards(_micro_batches(corpus.train, step, train_config, device), rank, world_size)
        records.append({"step": step + 1, **train_step(model, optimizer, scheduler, shards, train_config.grad_clip)})
        if rank == 0:
            metrics.write(records[-1])
    weights = distributed.gather_state_dict(model)
    optimizer_state = distributed.gather_optimizer_state(model, optimizer)
    if rank == 0:
        single = build_model(model_config, train_config.seed)
        single.load_state_dict(weights)
        single_optimizer, single_scheduler = make_optimizer(single, train_config)
        single_optimizer.load_state_dict(optimizer_state)
        single_scheduler.load_state_dict(scheduler.state_dict())
        config = {"model": dataclasses.asdict(model_config), "train": dataclasses.asdict(train_config)}
        checkpoint.save_checkpoint(out, train_config.steps, single, single_optimizer, single_scheduler, config)
    return records


def train_expert_parallel(preset_name: str, world_size: int, steps: int | None = None, out=None) -> dict:
    """``k3course train --ep P``: spawn P local gloo ranks running :func:`train_ranks`; returns a summary.

    The corpus cache is built here first (the ranks then only memory-map it); ``out`` must hold no checkpoint.
    """
    out = Path(out) if out is not None else Path("runs") / f"{preset_name}-ep{world_size}"
    if checkpoint.latest_checkpoint(out) is not None:
        raise ValueError(f"out: {out} already holds checkpoints (expert-parallel runs do not resume)")
    data.stdlib_corpus()
    records = distributed.run_ranks(train_ranks, world_size, preset_name, steps, str(out),
                                    timeout_s=7 * 24 * 3600)[0]
    return {"out": str(out), "step": records[-1]["step"], "loss": records[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    """``torchrun --standalone --nproc-per-node P -m k3course.train --ep P --preset tiny [--steps N]``: one rank
    of an expert-parallel run (gloo on CPU; NCCL with rank r on GPU r when every rank has a GPU); ``--out DIR``
    as in ``k3course train``."""
    import argparse
    import os

    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m k3course.train", description=main.__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (must equal torchrun's P)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run me under torchrun (or use `k3course train --ep P`, which spawns the ranks itself)")
    world_size = int(os.environ["WORLD_SIZE"])
    if args.ep is not None and args.ep != world_size:
        parser.error(f"--ep {args.ep} must equal torchrun's --nproc-per-node ({world_size})")
    device = "cpu"
    if torch.cuda.device_count() >= world_size:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device == "cpu" else "nccl")
    rank = dist.get_rank()
    out = args.out or f"runs/{args.preset}-ep{world_size}"
    records = train_ranks(rank, world_size, args.preset, args.steps, out, device)
    if rank == 0:
        print(f"step {records[-1]['step']}: loss {records[-1]['loss']:.4f}; checkpoint and metrics.jsonl in {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # torchrun --nproc-per-node P -m k3course.train --ep P ...: one expert-parallel rank
    raise SystemExit(main())
