"""Everything but the routed experts is data-parallel: what a training step on P ranks adds to the one-process step.

Each of the P ranks holds the same model except for its block of routed experts (:func:`parallelize_experts`),
and reads its own 1/P of every micro-batch. With L_r the mean loss of rank r's shard (equal shard sizes), the
global loss is L = (1/P) Σ_r L_r, so after backward:

    replicated parameter θ:  ∂L/∂θ = (1/P) Σ_r ∂L_r/∂θ         an all-reduce (average), as DDP does
    routed expert θ_e:       ∂L/∂θ_e = (1/P) · (what arrived)   the exchanges already summed over the ranks

and the gradient norm for clipping is ‖g‖² = ‖g_replicated‖² + Σ_r ‖g_experts of r‖² (one more all-reduce).
The group is the one the model's experts were spread over. On a 2-D mesh (:func:`k3course.distributed.parallelize`)
FSDP averages every gradient itself (each a DTensor shard), the norm sums every rank's shards, and losses average
over every rank that routes (:func:`pool_group`). :func:`gather_state_dict` turns the ranks' blocks and shards
back into the one-process model's state (tests and lessons compare it with one process's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from k3course.distributed.ep import expert_parallel_layers
from k3course.distributed.fsdp import local_squared_norm


def expert_group(model: torch.nn.Module):
    """The process group ``model``'s experts are spread over (None: the default group); one for all layers."""
    layers = expert_parallel_layers(model)
    if not layers:
        raise ValueError("model: its experts are not expert-parallel (see k3course.distributed.parallelize_experts)")
    group = layers[0].dispatcher.group
    if any(layer.dispatcher.group is not group for layer in layers):
        raise ValueError("model: its MoE layers are spread over different process groups")
    return group


def pool_group(model: torch.nn.Module):
    """The process group of every rank that routes tokens through ``model``'s experts (each reading its share of
    the batch): the expert group, or on a 2-D mesh all ranks."""
    expert_group(model)  # the layers' check
    return expert_parallel_layers(model)[0].dispatcher.pool_group


def _expert_ids(model: torch.nn.Module) -> set[int]:
    """ids of the routed-expert parameters: each rank holds different ones, never all-reduced."""
    return {id(p) for layer in expert_parallel_layers(model) for p in layer.experts.parameters()}


def average_gradients(model: torch.nn.Module) -> None:
    """Gradients of L = mean over ranks of the ranks' losses: replicated ones all-reduced and divided by P,
    routed experts' divided by P (their contributions from all ranks already arrived through the exchanges).
    FSDP shards (DTensors) are left alone: their reduce-scatter averaged them."""
    group = expert_group(model)
    world_size, experts = dist.get_world_size(group), _expert_ids(model)
    for param in model.parameters():
        if param.grad is None or isinstance(param.grad, DTensor):
            continue
        if id(param) not in experts:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(world_size)


def clip_global_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip all gradients by the norm of the whole (unsharded) gradient, as ``clip_grad_norm_`` does on one
    process; returns that norm, the same on every rank.

    ‖g‖² = Σ_replicated ‖g‖² (equal on every rank) + all-reduce of Σ_this rank's own ‖g‖² (its experts, and
    its shards of FSDP-sharded gradients: each element lives on one rank), in float64; every gradient is
    multiplied by min(1, max_norm / (‖g‖ + 1e-6)).
    """
    experts = _expert_ids(model)
    with_grad = [p for p in model.parameters() if p.grad is not None]
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")
    is_own = [id(p) in experts or isinstance(p.grad, DTensor) for p in with_grad]
    squares = local_squared_norm([p.grad for p, own in zip(with_grad, is_own) if own], device)
    dist.all_reduce(squares, group=pool_group(model))
    replicated = [p.grad for p, own in zip(with_grad, is_own) if not own]
    norm = float((local_squared_norm(replicated, device) + squares).sqrt())
    scale = min(1.0, max_norm / (norm + 1e-6))
    for param in with_grad:
        param.grad.mul_(scale)
    return norm


def average_over_ranks(value: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """(1/P) Σ_r value_r over the P ranks that route (:func:`pool_group`), equal on every rank; value keeps its
    device and dtype (it travels through the model's device, which NCCL needs)."""
    group = pool_group(model)
    total = value.to(next(model.parameters()).device)
    dist.all_reduce(total, group=group)
    return (total / dist.get_world_size(group)).to(value.device)


def gather_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The single-process state dict on every rank: FSDP shards all-gathered (``full_tensor``), then each
    routed-expert tensor all-gathered from its blocks (padded to the largest block, then trimmed), everything
    else as it is. Loadable by the plain model."""
    group = expert_group(model)
    state = {key: value.full_tensor() if isinstance(value, DTensor) else value
             for key, value in model.state_dict().items()}
    parallel = {id(layer) for layer in expert_parallel_layers(model)}
    for prefix, module in model.named_modules():
        if id(module) in parallel:
            for name, _ in module.experts.named_parameters():
                key = f"{prefix}.experts.{name}" if prefix else f"experts.{name}"
                state[key] = _gather_blocks(state[key].detach(), module.dispatcher.expert_ranges, group)
    return state


def _gather_blocks(block: torch.Tensor, ranges: list[tuple[int, int]], group=None) -> torch.Tensor:
    """Concatenate every rank's block [E_r, ...] of one tensor, in rank order -> [n, ...]."""
    largest = max(end - start for start, end in ranges)
    padded = block.new_zeros((largest, *block.shape[1:]))
    padded[: block.shape[0]] = block
    pieces = [torch.empty_like(padded) for _ in ranges]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([piece[: end - start] for piece, (start, end) in zip(pieces, ranges)])
