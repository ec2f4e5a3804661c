"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): each rank writes its own shards, and a
checkpoint loads on any mesh (another world size, another dp_shard × ep) of :func:`~k3course.distributed.parallelize`.

Every tensor is saved as its global view, a DTensor on the run's mesh whose local piece is what this rank holds:

    non-expert weight [*]      FSDP's DTensor, Shard(0) over all N ranks
    routed experts [n, ...]    block e of "ep" (Shard(0)), FSDP-sharded within it over "dp_shard"
                               (_StridedShard(0, split_factor=E): dp_shard's pieces nest inside ep's blocks)
    routing bias, AdamW step   whole on every rank (DCP writes one copy)

and likewise AdamW's two moments of every weight. DCP writes the pieces and a metadata file mapping the global
views; a load reads, for each tensor of the loading ranks' layout, whichever saved pieces overlap it. Nothing is
gathered on one rank. The checkpoint is written into a hidden temporary folder and renamed to ``step-NNNNNN``
once every rank has written (a rename is atomic), so an interrupted run leaves the complete checkpoint or the
previous one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from k3course.distributed.ep import expert_parallel_layers

MOMENTS = ("exp_avg", "exp_avg_sq")


def step_folder(out: Path | str, step: int) -> Path:
    """out/step-NNNNNN: the sharded checkpoint of ``step``."""
    return Path(out) / f"step-{step:06d}"


def latest_sharded(out: Path | str) -> Path | None:
    """The last complete sharded checkpoint in ``out`` (a step folder holding DCP's .metadata), or None."""
    done = sorted(path for path in Path(out).glob("step-*") if (path / ".metadata").exists())
    return done[-1] if done else None


def _expert_view(local: torch.Tensor, n_experts: int, mesh: DeviceMesh) -> DTensor:
    """This rank's piece of an expert tensor as a DTensor of the global [n, ...] on the 2-D mesh."""
    dp_shard, ep = mesh["dp_shard"].size(), mesh["ep"].size()
    if n_experts % ep:
        raise ValueError(f"mesh: a sharded checkpoint needs ep = {ep} to divide the {n_experts} routed experts")
    shape = (n_experts, *local.shape[1:])
    placements = [_StridedShard(0, split_factor=ep) if dp_shard > 1 else Replicate(), Shard(0)]
    return DTensor.from_local(local, mesh, placements, shape=shape, stride=torch.empty(shape, device="meta").stride(),
                              run_check=False)


def _global_views(model: nn.Module, mesh: DeviceMesh) -> dict[int, object]:
    """{id(param): fn(tensor of param's layout) -> its global view} for every parameter of ``model``."""
    views = {id(param): lambda tensor: tensor for param in model.parameters()}
    for layer in expert_parallel_layers(model):
        for param in layer.experts.parameters():
            views[id(param)] = lambda tensor, n=layer.n_routed_experts: _expert_view(
                tensor.to_local() if isinstance(tensor, DTensor) else tensor, n, mesh)
    return views


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, extra: dict) -> dict:
    """The dict DCP saves and loads in place: {"model": {name: global view}, "optimizer": {name: {"step",
    "exp_avg", "exp_avg_sq"}}, "param_groups": the optimizer's settings per group (its learning rates among
    them), "extra": ``extra``}; the views share storage with the model and optimizer."""
    views = _global_views(model, mesh)
    names = dict(model.named_parameters())
    weights = {name: views[id(param)](param.detach()) for name, param in names.items()}
    persistent = model.state_dict().keys()
    weights.update({name: buffer for name, buffer in model.named_buffers() if name in persistent})
    moments = {}
    for name, param in names.items():
        state = optimizer.state[param]
        moments[name] = {"step": state["step"], **{key: views[id(param)](state[key]) for key in MOMENTS}}
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    return {"model": weights, "optimizer": moments, "param_groups": groups, "extra": extra}


def save_sharded(out: Path | str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 mesh: DeviceMesh, extra: dict | None = None) -> Path:
    """Write ``step``'s sharded checkpoint into out/step-NNNNNN (every rank calls it; see the module docstring);
    ``extra`` (e.g. the scheduler's state_dict) is saved as it is. Returns the folder."""
    final = step_folder(out, step)
    temporary = final.with_name(f".{final.name}.partial")
    if dist.get_rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)  # left by a run interrupted while writing
        temporary.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(_state(model, optimizer, mesh, extra or {}), checkpoint_id=temporary)
    dist.barrier()  # every rank's pieces are on disk
    if dist.get_rank() == 0:
        temporary.rename(final)
    dist.barrier()
    return final


def load_sharded(folder: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                 extra: dict | None = None) -> dict:
    """Load a checkpoint of :func:`save_sharded`, written on any mesh, into ``model`` and ``optimizer``
    (parallelized on ``mesh``; the optimizer's moments are made if it has not stepped yet), in place. Returns
    the saved ``extra``, read into a dict of the same keys as ``extra``."""
    for param in model.parameters():
        if not optimizer.state[param]:
            optimizer.state[param].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                                          exp_avg_sq=torch.zeros_like(param))
    state = _state(model, optimizer, mesh, dict(extra or {}))
    dcp.load(state, checkpoint_id=Path(folder))
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update(saved)
    return state["extra"]
