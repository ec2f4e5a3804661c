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
previous one. The folder also holds the run's config.json (the step among it), as a one-process checkpoint
does, so a run folder lists, reads and resumes either kind.

On one process (``mesh`` None, a plain model: every view the whole tensor) the same files are written and read
without a process group: a run that began sharded keeps its format when it goes on at one process.

The Hugging Face folder of a sharded model (:func:`save_pretrained`) is written from the same global views, one
tensor at a time: each is all-gathered when the writer reaches it, converted with its part, and let go once its
safetensors file is written, so rank 0, which writes, holds at most one output file and the part being made.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from k3course import pretrained_save
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


def _global_views(model: nn.Module, mesh: DeviceMesh | None) -> dict[int, object]:
    """{id(param): fn(tensor of param's layout) -> its global view} for every parameter of ``model``."""
    views = {id(param): lambda tensor: tensor for param in model.parameters()}
    for layer in expert_parallel_layers(model):
        for param in layer.experts.parameters():
            views[id(param)] = lambda tensor, n=layer.n_routed_experts: _expert_view(
                tensor.to_local() if isinstance(tensor, DTensor) else tensor, n, mesh)
    return views


def _weights(model: nn.Module, mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    """{name: global view} of every parameter and persistent buffer of ``model`` (buffers are whole)."""
    views = _global_views(model, mesh)
    weights = {name: views[id(param)](param.detach()) for name, param in model.named_parameters()}
    persistent = model.state_dict().keys()
    return weights | {name: buffer for name, buffer in model.named_buffers() if name in persistent}


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh | None, extra: dict) -> dict:
    """The dict DCP saves and loads in place: {"model": {name: global view}, "optimizer": {name: {"step",
    "exp_avg", "exp_avg_sq"}}, "param_groups": the optimizer's settings per group (its learning rates among
    them), "extra": ``extra``}; the views share storage with the model and optimizer (whose state is made
as AdamW's first step makes it for a weight that has none yet: step 0, zero moments)."""
    views = _global_views(model, mesh)
    names = dict(model.named_parameters())
    for param in names.values():  # AdamW's state as its first step makes it (a weight that had no gradient yet)
        if not optimizer.state[param]:
            optimizer.state[param].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                                          exp_avg_sq=torch.zeros_like(param))
    moments = {}
    for name, param in names.items():
        state = optimizer.state[param]
        moments[name] = {"step": state["step"], **{key: views[id(param)](state[key]) for key in MOMENTS}}
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    return {"model": _weights(model, mesh), "optimizer": moments, "param_groups": groups, "extra": extra}


def is_sharded_checkpoint(folder: Path | str) -> bool:
    """Whether ``folder`` is a checkpoint of :func:`save_sharded` (it holds DCP's .metadata)."""
    return (Path(folder) / ".metadata").is_file()


def _dcp(operation, state: dict, folder: Path, mesh: DeviceMesh | None) -> None:
    """``dcp.save`` / ``dcp.load`` of ``state`` at ``folder``: collectively over the ranks, or (``mesh`` None) in
    this process alone (DCP's note that it then assumes one process is the point, so it is not shown)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        operation(state, checkpoint_id=folder, no_dist=mesh is None)


def _barrier(mesh: DeviceMesh | None) -> None:
    if mesh is not None:
        dist.barrier()


def save_sharded(out: Path | str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 mesh: DeviceMesh | None, extra: dict | None = None, record: dict | None = None) -> Path:
    """Write ``step``'s sharded checkpoint into out/step-NNNNNN (every rank of ``mesh`` calls it; None: one
    process, a plain model; see the module docstring); ``extra`` (e.g. the scheduler's state_dict) is saved as it
    is, ``record`` (the run's settings) as config.json with the step added. Returns the folder."""
    final = step_folder(out, step)
    temporary = final.with_name(f".{final.name}.partial")
    writer = mesh is None or dist.get_rank() == 0
    if writer:
        shutil.rmtree(temporary, ignore_errors=True)  # left by a run interrupted while writing
        temporary.mkdir(parents=True)
    _barrier(mesh)
    _dcp(dcp.save, _state(model, optimizer, mesh, extra or {}), temporary, mesh)
    _barrier(mesh)  # every rank's pieces are on disk
    if writer:
        (temporary / "config.json").write_text(json.dumps({**(record or {}), "step": step}, indent=1))
        shutil.rmtree(final, ignore_errors=True)  # the same step written again (a resumed run's last step)
        temporary.rename(final)
    _barrier(mesh)
    return final


def load_sharded(folder: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh | None,
                 extra: dict | None = None) -> dict:
    """Load a checkpoint of :func:`save_sharded`, written on any mesh or one process, into ``model`` and
    ``optimizer`` (parallelized on ``mesh``; None: a plain model in one process), in place. Returns the saved
    ``extra``, read into a dict of the same keys as ``extra``."""
    state = _state(model, optimizer, mesh, dict(extra or {}))
    _dcp(dcp.load, state, Path(folder), mesh)
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update(saved)
    return state["extra"]


def pretrained_state(model: nn.Module, mesh: DeviceMesh) -> pretrained_save.LazyState:
    """``model``'s state dict (parallelized on ``mesh``) as a :class:`~k3course.pretrained_save.LazyState`: item
    access all-gathers one tensor's global view (every rank, in the same order); rank 0 keeps what it writes."""
    return pretrained_save.LazyState(_weights(model, mesh), keeps=dist.get_rank() == 0)


def save_pretrained(model: nn.Module, path: Path | str, mesh: DeviceMesh, layout: str = "kimi_linear",
                    max_shard_bytes: int = 5 * 2**30, mxfp4: bool = False) -> Path:
    """:meth:`K3Model.save_pretrained <k3course.model.K3Model.save_pretrained>` of a model parallelized on
    ``mesh`` (:func:`~k3course.distributed.parallelize`; or the blocks of
    :func:`~k3course.distributed.parallelize_experts` on ``make_mesh(1, P)``): every rank calls it; the tensors are
    all-gathered one at a time in the writer's order and rank 0 writes the one folder, file by file (the same
    layouts and options), holding at most one output file's tensors and the part being converted, never the
    whole model. Returns the folder once it is complete."""
    folder = pretrained_save.save(model.cfg, pretrained_state(model, mesh), path, layout, max_shard_bytes, mxfp4)
    dist.barrier()
    return folder
