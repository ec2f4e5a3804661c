"""FSDP2 × expert parallelism on a 2-D device mesh ("dp_shard", "ep"), as torchtitan composes them.

N = D · E ranks in a mesh of D rows ("dp_shard") and E columns ("ep"); rank (d, e) = d·E + e. Every rank reads
its 1/N of every micro-batch. What each rank holds:

    every non-expert weight    1/N of it: FSDP2 (``fully_shard``) over all N ranks, one unit per sub-layer of
                               each decoder layer (its mixer, its FFN) and one for the rest (embeddings,
                               norms, head, residual queries)
    routed experts             expert parallelism over "ep": the E ranks of row d split the experts into blocks
                               (:func:`~k3course.distributed.parallelize_experts`); each block FSDP-sharded
                               over "dp_shard": rank (d, e) holds 1/D of block e
    the routing bias           whole on every rank (a buffer), updated from statistics pooled over all N ranks

A forward all-gathers each unit's weights just before it runs and frees them after; a backward all-gathers
them again and reduce-scatters the gradients. FSDP2 finds a unit's backward through the tensors going in and
out of its forward, so the units are the sub-layers: a decoder layer reads and writes its residual stream, an
object, and returns no tensor (unsharded by layer, its weights would be freed when its backward needs them).

Gradients of the global loss L = (1/N) Σ_r L_r:

    non-expert θ:   ∂L/∂θ = (1/N) Σ_r ∂L_r/∂θ                   FSDP's reduce-scatter over N, averaging
    expert θ_e:     ∂L/∂θ_e = (1/N) Σ_d (Σ_e' ∂L_(d,e')/∂θ_e)    the all-to-all sums over the row's E ranks,
                                                                 the reduce-scatter over the D rows, ÷ N

D = 1 is :func:`~k3course.distributed.parallelize_experts`'s expert parallelism (non-experts sharded instead of
copied: the same steps), E = 1 plain FSDP (every rank holds every expert's 1/N).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from k3course.distributed.ep import expert_parallel_layers, parallelize_experts
from k3course.guards import is_number
from k3course.params import carry_marks

MESH_DIMS = ("dp_shard", "ep")


def make_mesh(dp_shard: int, ep: int, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D mesh ("dp_shard", "ep") of shape [dp_shard, ep] over all ranks of the default group (its size
    must be dp_shard · ep)."""
    for name, value in (("dp_shard", dp_shard), ("ep", ep)):
        if not is_number(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs torch.distributed.init_process_group(...) first")
    if dp_shard * ep != dist.get_world_size():
        raise ValueError(f"dp_shard × ep = {dp_shard} × {ep} must equal the {dist.get_world_size()} ranks")
    return init_device_mesh(device_type, (dp_shard, ep), mesh_dim_names=MESH_DIMS)


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard a K3Model (built identically on every rank, same seed) over ``mesh`` (:func:`make_mesh`), in place,
    before its optimizer is made; returns it. See the module docstring for what each rank then holds.

    The parameters become DTensors (each rank's shard in ``.to_local()``), keeping their marks (weight decay,
    learning-rate scale: :mod:`k3course.params`); forward, backward and the bias update are collectives that
    every rank calls together, with its own tokens (zero included)."""
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(f"mesh must be a DeviceMesh with dims {MESH_DIMS} (make_mesh), got {mesh!r}")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"mesh: spans {mesh.size()} of the {dist.get_world_size()} ranks; it must span them all")
    marks = dict(model.named_parameters())
    # torch warns at every forward that a unit returns a view (an in-place write into it would skip the unit's
    # backward all-gather); nothing in the model writes into a unit's output in place: tests/test_fsdp.py's
    # gradients equal one process's to 1e-12
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    parallelize_experts(model, group=mesh.get_group("ep"), pool_group=dist.group.WORLD)
    world = init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("dp",))
    whole_experts = {param for layer in expert_parallel_layers(model) for param in layer.experts.parameters()}
    if mesh["dp_shard"].size() > 1:
        for layer in expert_parallel_layers(model):
            experts = fully_shard(layer.experts, mesh=mesh["dp_shard"])
            experts.set_gradient_divide_factor(float(mesh.size()))  # Σ over the row's ranks came in the all-to-all
            experts.set_force_sum_reduction_for_comms(True)  # a sum, then ÷ N (gloo has no pre-scaled sum)
        whole_experts = set()
    # dp_shard = 1: the blocks stay whole, as parallelize_experts leaves them (average_gradients divides by E;
    # torch's one-rank "reduce-scatter" would divide a float64 gradient by the factor twice)
    for layer in model.layers:
        fully_shard(layer.mixer, mesh=world)
        fully_shard(layer.ffn, mesh=world, ignored_params=whole_experts)
    # the root too frees its gathered weights after each forward (torch keeps the root's for the backward it
    # expects): after an evaluation, which has none, every weight is a shard again (what a checkpoint reads)
    fully_shard(model, mesh=world, ignored_params=whole_experts, reshard_after_forward=True)
    for name, param in model.named_parameters():
        carry_marks(marks[name], param)
    return model


def local_squared_norm(tensors, device) -> torch.Tensor:
    """Σ ‖t‖² over this rank's part of ``tensors`` (a DTensor's local shard), float64 on ``device``."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.double().square().sum()
    return total
