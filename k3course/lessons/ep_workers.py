"""Per-rank functions that tests, the benchmark and notebook 13 run with :func:`k3course.distributed.run_ranks`.

They live in the package because spawned processes import functions by module name. A case is a dict:
kind 'moe' | 'latent', sizes (d, n, k, d_expert, n_shared), counts (tokens per rank), dedup, seed, dtype
(a torch dtype name, default 'float32'), and
optionally hot (a bias that pulls tokens towards the first experts, so ranks receive very uneven loads).
Every rank builds the same layer and the same global batch from the seed and keeps its own slice of it.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from k3course import pretrained_save, train
from k3course.distributed import (
    exchange,
    gather_state_dict,
    make_mesh,
    parallelize,
    parallelize_experts,
    save_pretrained,
)
from k3course.distributed.sharded_checkpoint import load_sharded, pretrained_state, save_sharded
from k3course.moe import LatentMoE, MoE
from k3course.moe.balancing import HISTOGRAM_BINS
from k3course.train.step import make_optimizer, rank_shards


def build_layer(case: dict) -> MoE:
    """The case's layer, in training mode, built from its seed (the same on every rank)."""
    cls = LatentMoE if case["kind"] == "latent" else MoE
    generator = torch.Generator().manual_seed(case["seed"])
    layer = cls(case["d"], case["n"], case["k"], n_shared_experts=case.get("n_shared", 1), expert_dim=case["d_expert"],
                balancing=case.get("balancing", "quantile"), generator=generator)
    if case.get("hot"):
        layer.bias[: case["n"] // 4] = case["hot"]
    return layer.train()


def global_batch(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [Σ counts, d], g [Σ counts, d]): the tokens of all ranks, and fixed output weights for the loss Σ g ⊙ y."""
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    m = sum(case["counts"])
    return torch.randn(m, case["d"], generator=generator), torch.randn(m, case["d"], generator=generator)


def rank_slice(case: dict, rank: int) -> slice:
    """The rows of the global batch that ``rank`` holds."""
    start = sum(case["counts"][:rank])
    return slice(start, start + case["counts"][rank])


def forward_backward(rank: int, world_size: int, case: dict) -> dict:
    """On one rank: y, the loss Σ g ⊙ y's gradients by parameter name, the routing, the counted traffic, the
    parameter shapes by name and the routing statistics pooled over the ranks."""
    dtype = getattr(torch, case.get("dtype", "float32"))
    layer = parallelize_experts(build_layer(case).to(dtype), dedup=case.get("dedup", False))
    x, g = (t[rank_slice(case, rank)].to(dtype) for t in global_batch(case))
    y = layer(x)
    (g * y).sum().backward()
    _, _, expert_idx, _ = layer.route(x)
    return {"y": y.detach(), "grads": {name: p.grad for name, p in layer.named_parameters()},
            "expert_idx": expert_idx, "traffic": dict(layer.dispatcher.last_traffic),
            "local_expert_range": layer.dispatcher.local_expert_range,
            "shapes": {name: tuple(t.shape) for name, t in layer.state_dict().items()},
            "routing": layer.load_statistics()}


def balancing_steps(rank: int, world_size: int, case: dict) -> dict:
    """``case["steps"]`` training steps of this rank's slice, each a forward then :meth:`update_bias`.

    The global batch of step s is drawn with seed + s. Returns per step the scores the update used [m_r, n],
    this rank's load per expert [n], and the bias before and after.
    """
    layer = parallelize_experts(build_layer(case), histogram_bins=case.get("bins", HISTOGRAM_BINS))
    steps = {"scores": [], "load": [], "bias_before": [], "bias_after": []}
    for step in range(case.get("steps", 2)):
        x, _ = global_batch({**case, "seed": case["seed"] + step})
        steps["bias_before"].append(layer.bias.clone())
        with torch.no_grad():
            layer(x[rank_slice(case, rank)])
        statistics = layer.balancing_statistics()
        steps["scores"].append(statistics["scores"])
        steps["load"].append(statistics["load"])
        layer.update_bias()
        steps["bias_after"].append(layer.bias.clone())
    return steps


def run_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Each case in turn, in one process group: 'balancing' cases by :func:`balancing_steps`, others by
    :func:`forward_backward`."""
    return [balancing_steps(rank, world_size, case) if case.get("test") == "balancing"
            else forward_backward(rank, world_size, case) for case in cases]


def failing(rank: int, world_size: int, how: str) -> None:
    """A rank that fails: rank 1 raises (how='raise'), dies in native code ('abort': SIGABRT, as a C++
    std::terminate does) or never joins the all-reduce the others wait in ('hang')."""
    if rank == 1:
        if how == "raise":
            raise RuntimeError("rank 1 failed on purpose")
        if how == "abort":
            os.abort()
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


def threads_at_exit(rank: int, world_size: int, folder: str) -> None:
    """Make an optimizer (its first use imports torch._dynamo, and with it the torch module that binds the default
    group as default arguments), then, when this rank's interpreter shuts down (atexit), write the names of the
    process's native threads to folder/threads_{rank}.txt (Linux: /proc/self/task)."""
    torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    tasks = Path("/proc/self/task")
    names = lambda: [(tasks / task / "comm").read_text().strip() for task in sorted(os.listdir(tasks))]
    atexit.register(lambda: (Path(folder) / f"threads_{rank}.txt").write_text("\n".join(names())))


def expert_parallel_steps(rank: int, world_size: int, case: dict) -> dict:
    """``case["train"].steps`` steps of the one training step (:class:`k3course.train.Stepper`, expert-parallel)
    of a K3Model preset, on ``case["batches"]`` (step i: a list of micro-batches), each rank reading its 1/P of
    every micro-batch, the model in ``case["dtype"]`` (default float32). Returns the per-step records and the
    gathered single-process state dict."""
    model_config, train_config = case["model"], case["train"]
    in_dtype = lambda config, seed, device: train.build_model(config, seed, device).to(case.get("dtype", torch.float32))
    stepper = train.Stepper(model_config, train_config, case["batches"].__getitem__, expert_parallel=True,
                            model_factory=in_dtype)
    records = [stepper() for _ in range(train_config.steps)]
    return {"records": records, "state": gather_state_dict(stepper.model)}


def _sharded_stepper(rank: int, world_size: int, case: dict) -> tuple[train.Stepper, object]:
    """(a Stepper over the model sharded by :func:`k3course.distributed.parallelize` on ``case["mesh"]`` =
    (dp_shard, ep), each rank reading its 1/N of every micro-batch; that mesh)."""
    mesh = make_mesh(*case["mesh"])
    sharded = lambda config, seed, device: parallelize(
        train.build_model(config, seed, device).to(case.get("dtype", torch.float32)), mesh)
    stepper = train.Stepper(case["model"], case["train"],
                            lambda step: rank_shards(case["batches"][step], rank, world_size),
                            model_factory=sharded)
    return stepper, mesh


def sharded_steps(rank: int, world_size: int, case: dict) -> dict:
    """:func:`expert_parallel_steps` on a 2-D mesh: the model sharded by :func:`k3course.distributed.parallelize`
    over ``case["mesh"]`` = (dp_shard, ep), each rank reading its 1/N of every micro-batch. Returns the per-step
    records, the gathered single-process state dict and "idle_expert": per step, whether some expert received
    no token-slot from this rank in it (read before the bias update)."""
    stepper, _ = _sharded_stepper(rank, world_size, case)
    loads = {}  # per MoE layer, its record after its last forward (the step's bias hook then clears it)
    for moe in stepper.model.moe_layers():
        moe.register_forward_hook(lambda moe, *_: loads.update({moe: moe.balancing_statistics()["load"]}))
    idle, records = [], []
    for _ in range(case["train"].steps):
        records.append(stepper())
        idle.append(any(bool((load == 0).any()) for load in loads.values()))
    return {"records": records, "state": gather_state_dict(stepper.model), "idle_expert": idle}


def bytes_held(rank: int, world_size: int, case: dict) -> dict[str, int]:
    """One step of :func:`sharded_steps` on ``case["mesh"]``, then what this rank holds, measured: {"weights",
    "gradients" (the step's, kept: not zeroed), "optimizer" (AdamW's moments)} in bytes of its local shards."""
    model_config, train_config = case["model"], case["train"]
    mesh = make_mesh(*case["mesh"])
    model = parallelize(train.build_model(model_config, train_config.seed), mesh)
    optimizer, scheduler = make_optimizer(model, train_config)
    inputs, targets = rank_shards(case["batches"][0], rank, world_size)[0]
    model(inputs, targets=targets)[1].backward()
    local = lambda tensor: tensor.to_local() if isinstance(tensor, DTensor) else tensor
    nbytes = lambda tensors: sum(local(t).numel() * t.element_size() for t in tensors)
    held = {"weights": nbytes(model.parameters()), "gradients": nbytes(p.grad for p in model.parameters())}
    optimizer.step()
    held["optimizer"] = nbytes(optimizer.state[p][key] for p in model.parameters() for key in ("exp_avg", "exp_avg_sq"))
    return held


def checkpointed_steps(rank: int, world_size: int, case: dict) -> dict:
    """:func:`sharded_steps` that may start from a sharded checkpoint (``case["load"]``: its folder, written on
    any mesh) and write one after step ``case["save_at"]`` into ``case["out"]``; trains to ``case["train"].steps``.
    Returns the gathered single-process state dict at the end."""
    train_config = case["train"]
    stepper, mesh = _sharded_stepper(rank, world_size, case)
    if case.get("load"):
        saved = load_sharded(case["load"], stepper.model, stepper.optimizer, mesh,
                             {"scheduler": stepper.scheduler.state_dict(), "step": 0})
        stepper.scheduler.load_state_dict(saved["scheduler"])
        stepper.steps_taken = saved["step"]
    while stepper.steps_taken < train_config.steps:
        stepper()
        if stepper.steps_taken == case.get("save_at"):
            save_sharded(case["out"], stepper.steps_taken, stepper.model, stepper.optimizer, mesh,
                         {"scheduler": stepper.scheduler.state_dict(), "step": stepper.steps_taken})
    return gather_state_dict(stepper.model)


class _HeldState(pretrained_save.LazyState):
    """A LazyState that measures, at each gather, the bytes of the gathered tensors still held by anyone (their
    storages' use counts beyond this record's own reference) and keeps the most: the gathered bytes this process
    held at once (the count only rises at a gather)."""

    def __init__(self, state: pretrained_save.LazyState):
        super().__init__(state.views, state.keeps)
        self.storages, self.peak = [], 0

    def __getitem__(self, name: str) -> torch.Tensor:
        whole = super().__getitem__(name)
        if isinstance(self.views[name], DTensor):
            held = lambda storage: torch._C._storage_Use_Count(storage._cdata) > 1
            self.storages = [storage for storage in self.storages if held(storage)] + [whole.untyped_storage()]
            self.peak = max(self.peak, sum(storage.nbytes() for storage in self.storages))
        return whole


def pretrained_folders(rank: int, world_size: int, case: dict) -> dict:
    """For each (model config, save options) of ``case["saves"]``: that model trained ``case["train"].steps``
    steps sharded on ``case["mesh"]`` (as :func:`sharded_steps`), then written by every rank through
    :func:`k3course.distributed.save_pretrained` into case["out"]/<index>, and once more into
    case["out"]/<index>-held measuring the gathered bytes held at once (:class:`_HeldState`). Returns per save
    the gathered single-process state dict, that peak and K3Model.save_pretrained's refusal of the sharded model."""
    results = []
    for index, (model_config, options) in enumerate(case["saves"]):
        stepper, mesh = _sharded_stepper(rank, world_size, {**case, "model": model_config})
        for _ in range(case["train"].steps):
            stepper()
        model = stepper.model
        save_pretrained(model, Path(case["out"]) / str(index), mesh, **options)
        held = _HeldState(pretrained_state(model, mesh))
        pretrained_save.save(model.cfg, held, Path(case["out"]) / f"{index}-held", **options)
        try:
            model.save_pretrained(Path(case["out"]) / "refused")
            refusal = None
        except ValueError as error:
            refusal = str(error)
        results.append({"state": gather_state_dict(model), "peak": held.peak, "refusal": refusal})
    return results


def exchange_labels(rank: int, world_size: int, counts: list[list[int]],
                    guard: bool | None = None) -> list[tuple[int, int]]:
    """On one rank: send rows labelled (this rank, row index), counts[rank][r] of them to rank r, through the
    package's all-to-all (``guard``: its padding against empty sends, None: the backend's default,
    :func:`k3course.distributed.exchange`), and the reverse exchange, which must bring every row home; returns
    the labels of the rows received, in the order they arrived."""
    send_splits = counts[rank]
    recv_splits = [row[rank] for row in counts]
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    rows = torch.stack([torch.full((sum(send_splits),), float(rank)), torch.arange(float(sum(send_splits)))], 1)
    received = exchange(rows.to(device), recv_splits, send_splits, guard=guard)
    back = exchange(received, send_splits, recv_splits, guard=guard)
    if not torch.equal(back.cpu(), rows):
        raise AssertionError(f"rank {rank}: the reverse exchange did not bring every row home")
    return [(int(source), int(index)) for source, index in received.tolist()]
