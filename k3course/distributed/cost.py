"""What expert parallelism costs at scale, in expectation (chapter 13): bytes per token per MoE layer under
uniform routing, one layer's all-to-all time on a cluster of NVLink domains joined by a network (with a fixed
latency per exchange, which is what decoding pays), the experts' compute time and how much of the exchange
overlapping hides, the weights each rank holds at an EP degree, and the slots a capacity factor drops.

:func:`~k3course.distributed.plan.traffic_bytes` counts what one routing actually moves; these formulas give its
expectation for n experts spread evenly over P ranks, which is what sizes a real deployment.
"""

from __future__ import annotations

import math

import torch

from k3course import accounting
from k3course.config import K3Config
from k3course.guards import is_number

NVLINK, NIC = 900e9, 100e9  # bytes/s per GPU and direction: NVLink 5, one 800 Gb/s NIC (assumed, B300-class)
CLUSTERS = {"DGX B300 (8)": (8, 8), "SuperNode (64)": (64, 8), "NVL72 (72)": (72, 72)}  # (ranks, GPUs per domain)
FP8_VALUE_BYTES = 1 + 4 / 128  # one byte a value plus one fp32 scale per 128 values (DeepEP)
GPU_FLOPS = 2.25e15  # dense bf16 FLOP/s per GPU (assumed, B200/B300-class)
LATENCY = 20e-6  # s a small all-to-all takes whatever its bytes: launch, synchronisation, the first hop (assumed)


def expected_ranks_reached(n: int, k: int, ranks: int) -> float:
    """Other ranks a token's k distinct experts land on, on average (uniform routing, n/P experts a rank):
    (P − 1)·(1 − C(n − n/P, k) / C(n, k))."""
    miss = math.comb(n - n // ranks, k) / math.comb(n, k)  # P(no expert of a given rank is chosen)
    return (ranks - 1) * (1 - miss)


def remote_slots(k: int, ranks: int) -> float:
    """Token-slots that leave their rank, on average: k·(P − 1)/P."""
    return k * (ranks - 1) / ranks


def _value_bytes(dispatch: str) -> float:
    if dispatch not in ("bf16", "fp8"):
        raise ValueError(f"dispatch must be 'bf16' or 'fp8', got {dispatch!r}")
    return 2 if dispatch == "bf16" else FP8_VALUE_BYTES


def dispatch_bytes_per_token(width: int, k: int, n: int, ranks: int, dedup: bool = False,
                             dispatch: str = "bf16") -> float:
    """Expected bytes one token sends to reach its experts: a row of ``width`` values per remote slot (naive)
    or per remote rank (dedup), in bf16 or fp8 with scales."""
    rows = expected_ranks_reached(n, k, ranks) if dedup else remote_slots(k, ranks)
    return rows * width * _value_bytes(dispatch)


def bytes_per_token(width: int, k: int, n: int, ranks: int, dedup: bool = False, dispatch: str = "bf16") -> float:
    """Expected bytes one token moves per MoE layer: its dispatch plus the bf16 combine (a row per remote slot)."""
    return dispatch_bytes_per_token(width, k, n, ranks, dedup, dispatch) + remote_slots(k, ranks) * width * 2


def all_to_all_seconds(tokens: int, width: int, k: int, n: int, ranks: int, per_domain: int, dedup: bool = False,
                       dispatch: str = "bf16", nvlink: float = NVLINK, nic: float = NIC,
                       latency_s: float = 0.0) -> float:
    """One layer's dispatch + combine on one GPU holding ``tokens`` tokens, with uniform routing.

    Of the P − 1 other ranks, ``per_domain`` − 1 share the GPU's NVLink domain; each phase's bytes split in that
    proportion and take latency_s + max(NVLink bytes / nvlink, network bytes / nic). Training moves thousands of
    tokens a GPU and the bytes dominate (latency_s = 0 leaves it out); decoding moves a few, and the latency does."""
    near = (per_domain - 1) / (ranks - 1)  # share of the remote traffic that stays in the NVLink domain
    seconds = 0.0
    for phase_bytes in (tokens * dispatch_bytes_per_token(width, k, n, ranks, dedup, dispatch),
                        tokens * remote_slots(k, ranks) * width * 2):
        seconds += latency_s + max(phase_bytes * near / nvlink, phase_bytes * (1 - near) / nic)
    return seconds


def expert_seconds(tokens: int, width: int, expert_dim: int, k: int, flops_per_s: float) -> float:
    """The routed experts' compute for ``tokens`` tokens on one GPU (uniform routing: each GPU receives as many
    slots as it sends): k slots a token, 3 matrices of width × expert_dim each (gate, up, down), 2 FLOPs a
    multiply-add: ``tokens · k · 6 · width · expert_dim / flops_per_s``."""
    return tokens * k * 6 * width * expert_dim / flops_per_s


def overlapped_seconds(compute_s: float, exchange_s: float, chunks: int) -> float:
    """One MoE layer whose tokens are split into ``chunks`` equal parts, the exchange of one part running while
    another part computes (a two-stage pipeline): the slower stage runs throughout, the faster one shows only for
    the first (or last) part: ``max(c, e) + min(c, e) / chunks``. chunks = 1 is no overlap: c + e."""
    if not is_number(chunks) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    return max(compute_s, exchange_s) + min(compute_s, exchange_s) / chunks


def weight_bytes_per_rank(cfg: K3Config, ranks: int, dtype_bytes: int = 2) -> dict[str, int]:
    """The weights one rank holds when the routed experts are spread over ``ranks`` ranks and everything else is
    replicated: {"experts": the largest block, ⌈n/P⌉ experts of every MoE layer, "replicated": all other
    parameters} in bytes of ``dtype_bytes``."""
    if not is_number(ranks) or not 1 <= ranks <= cfg.n_routed_experts:
        raise ValueError(f"ranks must be an int in [1, {cfg.n_routed_experts}], got {ranks!r}")
    count = accounting.param_count(cfg)
    routed_total = count.components["routed_experts"][0]
    block = -(-cfg.n_routed_experts // ranks)  # the first ranks hold one more when P does not divide n
    return {"experts": routed_total * block // cfg.n_routed_experts * dtype_bytes,
            "replicated": (count.total - routed_total) * dtype_bytes}


def capacity_drop_fraction(load: torch.Tensor, capacity_factor: float) -> float:
    """The share of token-slots a capacity-limited layer (GShard, Switch) drops: every expert takes at most
    C = ⌊capacity_factor · Σ load / n⌋ slots, the rest skip it (they keep only the residual and the other
    experts). load [n] slots per expert -> Σ max(0, load_j − C) / Σ load."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor!r}")
    load = load.double()
    capacity = math.floor(capacity_factor * float(load.sum()) / load.numel())
    return float((load - capacity).clamp(min=0).sum() / load.sum())


def _mesh_parameters(cfg: K3Config, dp_shard: int, ep: int, **counts: int) -> tuple[int, float]:
    """The parameters a dp_shard × ep mesh splits: (P_rest, P_block), the non-expert parameters and the largest
    block of ⌈n/ep⌉ routed experts of every layer, P_block = P_routed · ⌈n/ep⌉ / n. dp_shard, ep and the
    caller's other ``counts`` must be positive ints (checked in that order), ep at most n."""
    for name, value in {"dp_shard": dp_shard, "ep": ep, **counts}.items():
        if not is_number(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if ep > cfg.n_routed_experts:
        raise ValueError(f"ep must be at most the {cfg.n_routed_experts} routed experts, got {ep}")
    count = accounting.param_count(cfg)
    routed = count.components["routed_experts"][0]
    return count.total - routed, routed * -(-cfg.n_routed_experts // ep) / cfg.n_routed_experts


def training_bytes_per_rank(cfg: K3Config, dp_shard: int, ep: int, weight_bytes: int = 2, grad_bytes: int = 2,
                            state_bytes: int = 8) -> dict[str, float]:
    """What one rank of FSDP2 × EP (:func:`k3course.distributed.parallelize`, N = dp_shard · ep ranks) holds for
    training, in bytes: {"weights", "gradients", "optimizer"}, each P_rank times the bytes per value, with

        P_rank = (P_total − P_routed) / N  +  P_routed · (⌈n/ep⌉ / n) / dp_shard

    (every non-expert weight 1/N; the largest block of ⌈n/ep⌉ routed experts, 1/dp_shard of it).
    ``state_bytes``: the optimizer's per value (AdamW's two fp32 moments: 8). FSDP's padding of a dimension
    that N does not divide is left out (< one row a tensor)."""
    rest, block = _mesh_parameters(cfg, dp_shard, ep)
    per_rank = rest / (dp_shard * ep) + block / dp_shard
    return {"weights": per_rank * weight_bytes, "gradients": per_rank * grad_bytes,
            "optimizer": per_rank * state_bytes}


def replicated_training_bytes_per_rank(cfg: K3Config, ep: int, weight_bytes: int = 2, grad_bytes: int = 2,
                                       state_bytes: int = 8) -> dict[str, float]:
    """:func:`training_bytes_per_rank` for replicated data parallelism × EP
    (:func:`k3course.distributed.parallelize_experts`: every weight but the routed experts whole on every rank,
    with its gradient and optimizer state; the largest block of ⌈n/ep⌉ experts whole):

        P_rank = (P_total − P_routed)  +  P_routed · ⌈n/ep⌉ / n"""
    held = weight_bytes_per_rank(cfg, ep, dtype_bytes=1)
    per_rank = held["experts"] + held["replicated"]
    return {"weights": per_rank * weight_bytes, "gradients": per_rank * grad_bytes, "optimizer": per_rank * state_bytes}


def step_collective_bytes(cfg: K3Config, dp_shard: int, ep: int, tokens: int, weight_bytes: int = 2,
                          grad_bytes: int = 2) -> dict[str, float]:
    """The bytes one rank of FSDP2 × EP (N = dp_shard · ep ranks) receives in the collectives of one optimizer
    step over ``tokens`` tokens a rank (one micro-batch), ring algorithms, uniform routing:

        all-gather       2 · w · (P_rest (N − 1)/N + P_block (D − 1)/D)   each weight before its forward and again
                                                                          before its backward (freed in between)
        reduce-scatter   g · (P_rest (N − 1)/N + P_block (D − 1)/D)       each gradient, summed, 1/N (1/D) kept
        all-to-all       2 · L · tokens · bytes_per_token                 dispatch + combine per MoE layer, forward
                                                                          and backward (latent rows, bf16)

    P_rest: the non-expert parameters, P_block: a rank's ⌈n/ep⌉ experts of every layer, D = dp_shard, L: MoE
    layers, w / g: bytes per weight / gradient value. (Replicated DP's all-reduce of the same gradients is a
    reduce-scatter plus one all-gather: FSDP moves one all-gather more, 1.5× the bytes, for 1/N of the memory.)
    The scalars (the gradient norm, the loss, the balancing histograms) are a few KiB and left out."""
    rest, block = _mesh_parameters(cfg, dp_shard, ep, tokens=tokens)
    ranks = dp_shard * ep
    sharded = rest * (ranks - 1) / ranks + block * (dp_shard - 1) / dp_shard
    width = cfg.latent_dim or cfg.d_model
    exchange = bytes_per_token(width, cfg.top_k, cfg.n_routed_experts, ep) if ep > 1 else 0.0
    return {"all-gather": 2 * weight_bytes * sharded, "reduce-scatter": grad_bytes * sharded,
            "all-to-all": 2 * cfg.n_moe_layers * tokens * exchange}
