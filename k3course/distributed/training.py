"""Training a K3Model with expert parallelism: MoE layers expert-parallel, everything else data-parallel.

Each of the P ranks holds the same model except for its block of routed experts, and reads its own 1/P of
every micro-batch. With L_r the mean loss of rank r's shard (equal shard sizes), the global loss is
L = (1/P) Σ_r L_r, so after backward:

    replicated parameter θ:  ∂L/∂θ = (1/P) Σ_r ∂L_r/∂θ         an all-reduce (average), as DDP does
    routed expert θ_e:       ∂L/∂θ_e = (1/P) · (what arrived)   the exchanges already summed over the ranks

and the gradient norm for clipping is ‖g‖² = ‖g_replicated‖² + Σ_r ‖g_experts of r‖² (one more all-reduce).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from k3course.distributed.ep import ExpertParallelMoE
from k3course.moe import MoE


def make_expert_parallel(model: torch.nn.Module, group=None, dedup: bool = False) -> torch.nn.Module:
    """Replace every MoE / LatentMoE submodule of ``model`` (built identically on every rank) in place by its
    :class:`ExpertParallelMoE`; returns ``model``. Parameter names are unchanged (expert tensors sliced)."""
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, MoE) and not isinstance(module, ExpertParallelMoE)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ExpertParallelMoE.from_moe(module, group, dedup))
    return model


def _expert_ids(model: torch.nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.expert_parameters()}


def average_gradients(model: torch.nn.Module, group=None) -> None:
    """Gradients of L = mean over ranks of the ranks' losses: replicated ones all-reduced and divided by P,
    routed experts' divided by P (their contributions from all ranks already arrived through the exchanges)."""
    world_size, experts = dist.get_world_size(group), _expert_ids(model)
    for param in model.parameters():
        if param.grad is None:
            continue
        if id(param) not in experts:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(world_size)


def clip_global_grad_norm(model: torch.nn.Module, max_norm: float, group=None) -> float:
    """Clip all gradients by the norm of the whole (unsharded) gradient, as ``clip_grad_norm_`` does on one
    process; returns that norm, the same on every rank.

    ‖g‖² = Σ_replicated ‖g‖² (equal on every rank) + all-reduce of Σ_this rank's experts ‖g‖².
    """
    experts = _expert_ids(model)
    with_grad = [p for p in model.parameters() if p.grad is not None]
    squares = {kind: torch.zeros((), dtype=torch.float64) for kind in ("replicated", "experts")}
    for param in with_grad:
        squares["experts" if id(param) in experts else "replicated"] += param.grad.double().square().sum()
    dist.all_reduce(squares["experts"], group=group)
    norm = float((squares["replicated"] + squares["experts"]).sqrt())
    scale = min(1.0, max_norm / (norm + 1e-6))
    for param in with_grad:
        param.grad.mul_(scale)
    return norm


def train_step(model: torch.nn.Module, optimizer, scheduler, micro_batches, grad_clip: float, group=None) -> dict:
    """One expert-parallel optimizer step over this rank's shards of the micro-batches [(inputs, targets), ...].

    As :func:`k3course.train.train_step` on the concatenated batch: gradients averaged over the ranks, clipped by
    the global norm, then the step and the balancing update (a collective). Returns {"loss": the mean over
    ranks and micro-batches, "lr", "grad_norm"}.
    """
    model.train()
    total = torch.zeros((), dtype=torch.float64)
    for inputs, targets in micro_batches:
        _, loss, _ = model(inputs, targets=targets)
        (loss / len(micro_batches)).backward()
        total += loss.detach().double().cpu()
    average_gradients(model, group)
    grad_norm = clip_global_grad_norm(model, grad_clip, group)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    for moe in model.moe_layers():
        moe.update_bias()
    dist.all_reduce(total, group=group)
    return {"loss": float(total) / (len(micro_batches) * dist.get_world_size(group)), "lr": lr, "grad_norm": grad_norm}


def gather_state_dict(model: torch.nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The single-process state dict on every rank: each routed-expert tensor all-gathered from its blocks
    (padded to the largest block, then trimmed), everything else as it is. Loadable by the plain model."""
    state = model.state_dict()
    for prefix, module in model.named_modules():
        if isinstance(module, ExpertParallelMoE):
            for name, param in module.experts.named_parameters():
                state[f"{prefix}.experts.{name}"] = _gather_blocks(param.detach(), module.expert_ranges, group)
    return state


def _gather_blocks(block: torch.Tensor, ranges: list[tuple[int, int]], group=None) -> torch.Tensor:
    """Concatenate every rank's block [E_r, ...] of one tensor, in rank order -> [n, ...]."""
    largest = max(end - start for start, end in ranges)
    padded = block.new_zeros((largest, *block.shape[1:]))
    padded[: block.shape[0]] = block
    pieces = [torch.empty_like(padded) for _ in ranges]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([piece[: end - start] for piece, (start, end) in zip(pieces, ranges)])


def gather_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group=None) -> dict:
    """``optimizer.state_dict()`` with every routed expert's per-parameter state (Adam's moments) all-gathered,
    so the single-process model's optimizer can load it (its parameters come in the same order)."""
    blocks = {id(p): m.expert_ranges for m in model.modules() if isinstance(m, ExpertParallelMoE)
              for p in m.expert_parameters()}
    params = [p for group_ in optimizer.param_groups for p in group_["params"]]
    state = optimizer.state_dict()
    for index, param in enumerate(params):
        if id(param) in blocks and index in state["state"]:
            state["state"][index] = {key: _gather_blocks(value, blocks[id(param)], group)
                                     if torch.is_tensor(value) and value.shape == param.shape else value
                                     for key, value in state["state"][index].items()}
    return state


def train_ranks(rank: int, world_size: int, preset_name: str, steps: int | None, out: str) -> list[dict]:
    """``k3course train --ep P`` on one rank: the preset's run with MoE layers expert-parallel, each rank reading
    its 1/P of every micro-batch of the one-process run. Rank 0 writes metrics.jsonl after every step and, at
    the end, one single-process checkpoint (weights and optimizer gathered) that ``k3course generate`` and a
    one-process ``--resume`` can load. Returns the per-step records."""
    import json
    from pathlib import Path

    from k3course import checkpoint, data
    from k3course.train import build_model, make_optimizer, train_preset

    model_config, train_config = train_preset(preset_name)
    if steps is not None:
        train_config = train_config.replace(steps=steps)
    if train_config.batch_size % world_size:
        raise ValueError(f"--ep {world_size} must divide the preset's batch_size {train_config.batch_size}")
    corpus = data.stdlib_corpus()
    model = make_expert_parallel(build_model(model_config, train_config.seed))
    optimizer, scheduler = make_optimizer(model, train_config)
    out = Path(out)
    records = []
    for step in range(train_config.steps):
        batches = [data.batch_at(corpus.train, step * train_config.grad_accum + j, train_config.batch_size,
                                 train_config.seq_len, train_config.seed) for j in range(train_config.grad_accum)]
        shards = [(inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]) for inputs, targets in batches]
        records.append({"step": step + 1, **train_step(model, optimizer, scheduler, shards, train_config.grad_clip)})
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "metrics.jsonl", "a") as file:
                file.write(json.dumps(records[-1]) + "\n")
    weights, optimizer_state = gather_state_dict(model), gather_optimizer_state(model, optimizer)
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
    from pathlib import Path

    from k3course import checkpoint, data
    from k3course.distributed.launch import run_ranks

    out = Path(out) if out is not None else Path("runs") / f"{preset_name}-ep{world_size}"
    if checkpoint.latest_checkpoint(out) is not None:
        raise ValueError(f"out: {out} already holds checkpoints (expert-parallel runs do not resume)")
    data.stdlib_corpus()
    records = run_ranks(train_ranks, world_size, preset_name, steps, str(out), timeout_s=7 * 24 * 3600)[0]
    return {"out": str(out), "step": records[-1]["step"], "loss": records[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    """``torchrun --standalone --nproc-per-node P -m k3course.distributed.training --preset tiny [--steps N]``:
    one rank of the run (gloo on CPU, NCCL when every rank has a GPU); ``--out DIR`` as in ``k3course train``."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m k3course.distributed.training", description=main.__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (must equal torchrun's P)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run me under torchrun (or use `k3course train --ep P`, which spawns the ranks itself)")
    if args.ep is not None and args.ep != int(os.environ["WORLD_SIZE"]):
        parser.error(f"--ep {args.ep} must equal torchrun's --nproc-per-node ({os.environ['WORLD_SIZE']})")
    dist.init_process_group("nccl" if torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]) else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = args.out or f"runs/{args.preset}-ep{world_size}"
    records = train_ranks(rank, world_size, args.preset, args.steps, out)
    if rank == 0:
        print(f"step {records[-1]['step']}: loss {records[-1]['loss']:.4f}; checkpoint and metrics.jsonl in {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
