"""One optimizer step of K3 on bytes: AdamW, warmup + cosine, clipping, accumulation, MoE balancing; evaluation.

    for each of the A micro-batches (inputs, targets) [B, T]:   loss_j = model(inputs, targets)   (nats/byte)
        backward(loss_j · n_j / N)                              gradients of the mean over all N counted bytes
    clip ‖g‖₂ to grad_clip;  AdamW step at lr(step);  zero the gradients
        its pre-step hook first: for each MoE layer, read its routing statistics, then update_bias()
        (all A micro-batches since the last; :class:`BiasUpdate`)

The learning rate is lr · f(step) with a linear warmup and a cosine decay to ``min_lr_ratio · lr``:

    f(s) = (s + 1) / W                                          s < W
    f(s) = r + (1 − r) · ½ (1 + cos(π (s − W) / (S − W)))       W ≤ s < S        (r = min_lr_ratio)

Micro-batch j of step s is window batch number s·A + j of the seeded stream (:func:`k3course.data.batch_at`),
so the data position is a function of the step. Bits per byte = loss / ln 2.

The same step runs on P ranks when the model's experts are expert-parallel
(:func:`k3course.distributed.parallelize_experts`): each rank reads its 1/P of every micro-batch
(:func:`rank_shards`), and the gradients are averaged over the ranks and clipped by the norm of the whole
gradient (:mod:`k3course.distributed.data_parallel`), so the step is the one-process step on the concatenated
batch. :class:`Stepper` holds a model, its optimizer and schedule and its batches, on one process or one rank.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3course import data, distributed
from k3course.config import K3Config
from k3course.train.config import TrainConfig

LN2 = math.log(2)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """f(step): linear warmup over ``warmup_steps``, then cosine from 1 down to ``min_lr_ratio`` at the end."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, train: TrainConfig) -> tuple[torch.optim.Optimizer, object]:
    """AdamW over ``model.param_groups(weight_decay, gate_lr_scale, lr)`` (the forget gates at lr × gate_lr_scale),
    with the MoE bias update as its pre-step hook (:class:`BiasUpdate`), and its warmup + cosine LambdaLR
    scheduler."""
    groups = model.param_groups(train.weight_decay, train.gate_lr_scale, lr=train.lr)
    optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=train.betas)
    optimizer.register_step_pre_hook(BiasUpdate(model))
    return optimizer, make_scheduler(optimizer, train)


def make_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig, step: int = 0):
    """The warmup + cosine LambdaLR of ``train.steps`` steps, placed at ``step``: the next optimizer step runs at
    lr · f(step) (``step`` > 0 needs an optimizer that a scheduler has driven before: its groups' initial_lr)."""
    factor = functools.partial(lr_factor, warmup_steps=train.warmup_steps, total_steps=train.steps,
                               min_lr_ratio=train.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=step - 1)


def balance_experts(model: torch.nn.Module) -> dict:
    """Every MoE layer's bias update from the routing of the micro-batches since its last update (unless the
    optimizer's pre-step hook, :class:`BiasUpdate`, already made it this step), and that routing's statistics
    (with expert-parallel experts both pool all ranks' routing: collectives).

    Returns {"max_violation": the worst layer's max_j load_j / mean load − 1, "max_violation_per_layer": [...]}
    as floats: :func:`balance_experts_on_device`, read back once.
    """
    return _violation_record(balance_experts_on_device(model).tolist())


def balance_experts_on_device(model: torch.nn.Module) -> torch.Tensor:
    """:func:`balance_experts` without reading anything back: each MoE layer's ``update_bias()`` when a training
    forward recorded routing since its last update (every rank alike), then the max-violation of the record that
    update used (its pooled max_j load_j / mean load − 1). Returns [n_moe_layers] float64 on the model's device."""
    per_layer = []
    for moe in model.moe_layers():
        if moe.balancer.pending:
            moe.balancer.max_violation(moe.dispatcher)  # a record without tokens on any rank is refused here
            moe.update_bias()
        per_layer.append(moe.balancer.last_violation)
    if not per_layer:
        return torch.zeros(0, dtype=torch.float64, device=next(model.parameters()).device)
    return torch.stack(per_layer)


class BiasUpdate:
    """The MoE layers' bias update as an optimizer pre-step hook (torchtitan's place for it when it composed
    expert parallelism with FSDP): ``optimizer.step()`` first moves every layer's bias from the routing of all
    the step's micro-batches (:func:`balance_experts_on_device`), then the weights. Registered by
    :func:`make_optimizer`, so wherever the step's forwards and backwards came from (gradient accumulation, P
    ranks, FSDP shards: every rank calls ``step()`` together), the bias moves once per optimizer step, never per
    micro-batch. The bias is a buffer, not a parameter: updated before or after the weights, it is the same."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        balance_experts_on_device(self.model)


def _violation_record(per_layer: list[float]) -> dict:
    return {"max_violation": max(per_layer, default=0.0), "max_violation_per_layer": per_layer}


def forward_precision(device: torch.device, autocast: torch.dtype | None):
    """The context the forward runs in: ``torch.autocast`` to ``autocast`` on ``device`` (None: nothing).

    Under autocast the weights stay float32 (the optimizer updates them there), matrix products run in the
    autocast dtype, and the KDA ops keep their recurrence and state in float32 (:mod:`k3course.ops.checks`).
    """
    if autocast is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    # torch notes once that RMSNorm of a bf16 input with fp32 weights skips its fused kernel: expected here
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    stack.enter_context(torch.autocast(torch.device(device).type, dtype=autocast))
    return stack


def _target_shares(micro_batches) -> torch.Tensor:
    """n_j / N for each micro-batch [A] (float64, on the targets' device): n_j its targets that count (not
    ``data.IGNORE``), N = Σ_j n_j; so the shares weigh the micro-batches' mean losses into the mean over every counted
    target of the step. Computed without a host read; a step with no counted target at all is refused."""
    counts = torch.stack([(targets != data.IGNORE).sum() for _, targets in micro_batches]).double()
    message = "micro_batches: every target is ignored (-100); a step needs at least one to learn from"
    if counts.device.type == "cpu":
        if counts.numpy().sum() == 0:  # host memory: a plain read, no device to wait for
            raise ValueError(message)
    else:
        torch._assert_async(counts.sum() > 0, message)  # fails the stream instead of waiting for it
    return counts / counts.sum()


def train_step(model: torch.nn.Module, optimizer, scheduler, micro_batches, grad_clip: float,
               autocast: torch.dtype | None = None) -> dict:
    """One optimizer step over ``micro_batches`` [(inputs [B, T], targets [B, T]), ...]; see the module docstring.
    ``autocast`` (e.g. torch.bfloat16) runs the forward passes under autocast (:func:`forward_precision`).

    With expert-parallel experts every rank calls it together with its own shard of each micro-batch: the
    gradients are then averaged over the ranks and clipped by the global norm, the loss averaged over the
    ranks, and the balancing statistics pooled, so every rank gets the one-process numbers of the whole batch.
    Micro-batch j's loss enters with weight n_j / N (its counted targets over the step's), so unequal micro-batches
    and ignored (-100) targets give the gradient of one batch holding them all.
    Returns {"loss": mean loss over the counted targets, "lr": the rate this step used, "grad_norm": ‖g‖₂ before
    clipping, "max_violation", "max_violation_per_layer"} as Python numbers: :func:`step_on_device`, then
    :func:`read_record` (the step's one host read, after all its work is queued).
    """
    return read_record(step_on_device(model, optimizer, scheduler, micro_batches, grad_clip, autocast))


def step_on_device(model: torch.nn.Module, optimizer, scheduler, micro_batches, grad_clip: float,
                   autocast: torch.dtype | None = None) -> dict:
    """:func:`train_step` without a host read on one process (forward, backward, clipping, AdamW, schedule, bias
    update: nothing waits for the device). Returns {"loss": 0-d float64, "lr": float (the scheduler's, a Python
    number), "grad_norm": 0-d, "max_violation_per_layer": [n_moe_layers] float64}, tensors on the model's device.
    With expert-parallel experts the exchanges and the global norm still read sizes and the norm back.
    """
    if not micro_batches:
        raise ValueError("micro_batches must hold at least one (inputs, targets) pair, got none")
    model.train()
    shares = _target_shares(micro_batches)  # [A] on the targets' device
    total = None  # the reported loss, summed in float64
    for (inputs, targets), share in zip(micro_batches, shares):
        with forward_precision(inputs.device, autocast):
            _, loss, _ = model(inputs, targets=targets)
        # a micro-batch whose targets are all ignored has a NaN mean and weight 0: it adds nothing, not a NaN
        weighted = torch.where(share > 0, loss * share, torch.zeros_like(loss))
        weighted.backward()
        total = weighted.detach().double() if total is None else total + weighted.detach().double()
    if distributed.expert_parallel_layers(model):  # P ranks: everything but the routed experts is data-parallel
        distributed.average_gradients(model)
        grad_norm = total.new_tensor(distributed.clip_global_grad_norm(model, grad_clip))
        total = distributed.average_over_ranks(total, model)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()  # the bias moves in its pre-step hook (make_optimizer's optimizers)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total, "lr": lr, "grad_norm": grad_norm,
            "max_violation_per_layer": balance_experts_on_device(model)}


def read_record(on_device: dict) -> dict:
    """:func:`step_on_device`'s record as Python floats, read back in one transfer: {"loss", "lr", "grad_norm",
    "max_violation" (the worst layer's), "max_violation_per_layer"}."""
    values = torch.cat([on_device["loss"].reshape(1), on_device["grad_norm"].double().reshape(1),
                        on_device["max_violation_per_layer"]])
    loss, grad_norm, *per_layer = values.tolist()
    return {"loss": loss, "lr": on_device["lr"], "grad_norm": grad_norm, **_violation_record(per_layer)}


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int,
             autocast: torch.dtype | None = None) -> float:
    """Mean next-byte cross-entropy (nats per byte) over ``windows`` [N, T + 1], in eval mode (bias frozen),
    the forward under ``autocast`` when given. Computed from the logits (in float32), so auxiliary balancing
    losses never enter a validation number.

    With expert-parallel experts every rank calls it together with the same windows: the chunks of
    ``batch_size`` windows are dealt out to the P ranks that route (all of a 2-D mesh) in turn (chunk i to rank
    i mod P; a rank with no chunk left in a round joins the experts' exchange with one window it does not
    count), and the sums of cross-entropies and bytes are all-reduced, so every rank returns the mean over all
    the windows.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    chunks = windows.split(batch_size)
    if distributed.expert_parallel_layers(model):
        group = distributed.pool_group(model)
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        rounds = [chunks[i: i + world_size] for i in range(0, len(chunks), world_size)]
        sums = [_cross_entropy_sum(model, mine[rank] if rank < len(mine) else mine[0][:1], device, autocast)
                for mine in rounds]
        counted = [total for total, mine in zip(sums, rounds) if rank < len(mine)]
        totals = torch.tensor([sum(t for t, _ in counted), sum(c for _, c in counted)], dtype=torch.float64,
                              device=device)
        dist.all_reduce(totals, group=group)
        total, count = totals.tolist()
    else:
        total, count = 0.0, 0
        for chunk in chunks:
            chunk_total, chunk_count = _cross_entropy_sum(model, chunk, device, autocast)
            total, count = total + chunk_total, count + chunk_count
    model.train(was_training)
    return total / count


def _cross_entropy_sum(model: torch.nn.Module, chunk: torch.Tensor, device, autocast) -> tuple[float, int]:
    """(Σ next-byte cross-entropy in nats, number of predicted bytes) of the windows ``chunk`` [b, T + 1]."""
    chunk = chunk.to(device)
    with forward_precision(device, autocast):
        logits, _, _ = model(chunk[:, :-1])
    total = F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum").item()
    return total, chunk[:, 1:].numel()


def compile_for_training(model: torch.nn.Module, train: TrainConfig, **compile_options) -> torch.nn.Module:
    """``torch.compile`` the model in place (``nn.Module.compile``: the same parameters and state_dict keys) for
    training with ``train``'s micro-batches: each MoE layer's routing record is first sized for one optimizer
    step's tokens (:meth:`~k3course.moe.MoE.reserve_statistics`), so the compiled forward has fixed shapes. The
    first step compiles (each of its micro-batches at most once: the record's write position is part of the
    graph); later steps reuse those graphs, with no graph break anywhere (tests/test_train.py reads dynamo's
    counters). ``compile_options`` go to ``torch.compile`` (e.g. ``backend="aot_eager"``), over
    :func:`training_compile_options` of the model's device. Returns the model."""
    for moe in model.moe_layers():
        moe.reserve_statistics(train.tokens_per_step)
    model.compile(**{**training_compile_options(next(model.parameters()).device), **compile_options})
    return model


def training_compile_options(device: torch.device | str) -> dict:
    """``torch.compile``'s options for a training step on ``device``: on CUDA ``mode="reduce-overhead"`` (CUDA
    graphs replay the step's kernels without launching each from the host: the step reads nothing back,
    :func:`step_on_device`), elsewhere torch's defaults ({})."""
    return {"mode": "reduce-overhead"} if torch.device(device).type == "cuda" else {}


def build_model(model_config: K3Config, seed: int, device: torch.device | str = "cpu",
                kernels: str | None = None) -> torch.nn.Module:
    """A freshly initialised K3Model, seeded (same seed, same weights), with the kernel backend ``kernels``
    (:meth:`K3Model.from_config <k3course.model.K3Model.from_config>`; None: ``K3COURSE_KERNELS``, default "auto")."""
    from k3course.model import K3Model

    torch.manual_seed(seed)
    return K3Model.from_config(model_config, device=device, kernels=kernels)


def _micro_batches(tokens, step: int, train: TrainConfig, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    first = step * train.grad_accum
    batches = [data.batch_at(tokens, first + j, train.batch_size, train.seq_len, train.seed)
               for j in range(train.grad_accum)]
    return [(inputs.to(device), targets.to(device)) for inputs, targets in batches]


def text_batches(tokens: torch.Tensor, train: TrainConfig, device: torch.device | str = "cpu"
                 ) -> Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Step i → its ``grad_accum`` micro-batches of ``tokens`` [(inputs [B, T], targets [B, T])] on ``device``:
    :func:`k3course.data.batch_at` windows i·grad_accum + j with ``train``'s batch shape and seed."""
    return functools.partial(_micro_batches, tokens, train=train, device=device)


class Stepper:
    """A freshly seeded model of ``model_config`` (``model_factory``, default :func:`build_model`) with its
    optimizer and schedule (:func:`make_optimizer`), trained one optimizer step per call on ``batches(i)`` for
    i = ``steps_taken`` = 0, 1, 2, …

    ``stepper()`` returns :func:`train_step`'s record; ``autocast``: the forward's dtype (None: float32).
    ``expert_parallel``: this process is one rank of the default process group; the model's routed experts are
    spread over the ranks (:func:`k3course.distributed.parallelize_experts`, before the optimizer is made) and
    each call trains on this rank's 1/P of ``batches(i)`` (:func:`rank_shards`), together with the other ranks.
    ``mesh`` (dp_shard, ep), with ``expert_parallel``: the model is sharded instead by
    :func:`k3course.distributed.parallelize` on that 2-D mesh (FSDP2 × EP; ``self.mesh`` the DeviceMesh).
    The loop of every run: ``k3course train`` (:mod:`k3course.train.loop`), chapter 12's claims, ``bench
    train``, the probes, the capstone and chapter 13's expert-parallel steps.
    """

    def __init__(self, model_config: K3Config, train: TrainConfig, batches: Callable[[int], list],
                 device: torch.device | str = "cpu", *, autocast: torch.dtype | None = None,
                 expert_parallel: bool = False, mesh: tuple[int, int] | None = None,
                 model_factory: Callable[[K3Config, int, object], torch.nn.Module] = build_model):
        self.model = model_factory(model_config, train.seed, device)
        self.expert_parallel, self.mesh = expert_parallel, None
        if expert_parallel and mesh is not None:
            self.mesh = distributed.make_mesh(*mesh, device_type=torch.device(device).type)
            distributed.parallelize(self.model, self.mesh)
        elif expert_parallel:
            distributed.parallelize_experts(self.model)
        if expert_parallel:
            if train.batch_size % dist.get_world_size():
                raise ValueError(f"train.batch_size {train.batch_size} must be a multiple of the "
                                 f"{dist.get_world_size()} expert-parallel ranks")
        self.optimizer, self.scheduler = make_optimizer(self.model, train)
        self.train, self.batches, self.autocast, self.steps_taken = train, batches, autocast, 0

    def __call__(self) -> dict:
        """The next step: :func:`train_step`'s record, in Python numbers (one host read, after the step)."""
        return read_record(self.step_on_device())

    def step_on_device(self) -> dict:
        """The next step with no host read (one process): :func:`step_on_device`'s record, tensors on the device."""
        batches = self.batches(self.steps_taken)
        if self.expert_parallel:
            batches = rank_shards(batches, dist.get_rank(), dist.get_world_size())
        record = step_on_device(self.model, self.optimizer, self.scheduler, batches, self.train.grad_clip,
                                self.autocast)
        self.steps_taken += 1
        return record


def rank_shards(micro_batches, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s 1/P of the rows of every micro-batch [(inputs [B, T], targets [B, T]), ...]."""
    return [(inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]) for inputs, targets in micro_batches]
