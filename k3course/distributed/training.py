"""Training a K3Model with expert parallelism: MoE layers expert-parallel, everything else data-parallel.

Each of the P ranks holds the same model except for its block of routed experts, and reads its own 1/P of
every micro-batch. With L_r the mean loss of rank r's shard (equal shard sizes), the global loss is
L = (1/P) Σ_r L_r, so after backward:

    replicated parameter θ:  ∂L/∂θ = (1/P) Σ_r ∂L_r/∂θ         an all-reduce (average), as DDP does
    routed expert θ_e:       ∂L/∂θ_e = (1/P) · (what arrived)   the exchanges already summed over the ranks

and the gradient norm for clipping is ‖g‖² = ‖g_replicated‖² + Σ_r ‖g_experts of r‖² (one more all-reduce).
"""

from __future__ import annotations

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
