"""What expert parallelism costs at scale, in expectation (chapter 13): bytes per token per MoE layer under
uniform routing, and one layer's all-to-all time on a cluster of NVLink domains joined by a network.

:func:`~k3course.distributed.plan.traffic_bytes` counts what one routing actually moves; these formulas give its
expectation for n experts spread evenly over P ranks, which is what sizes a real deployment.
"""

from __future__ import annotations

import math

NVLINK, NIC = 900e9, 100e9  # bytes/s per GPU and direction: NVLink 5, one 800 Gb/s NIC (assumed, B300-class)
CLUSTERS = {"DGX B300 (8)": (8, 8), "SuperNode (64)": (64, 8), "NVL72 (72)": (72, 72)}  # (ranks, GPUs per domain)
FP8_VALUE_BYTES = 1 + 4 / 128  # one byte a value plus one fp32 scale per 128 values (DeepEP)


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
                       dispatch: str = "bf16", nvlink: float = NVLINK, nic: float = NIC) -> float:
    """One layer's dispatch + combine on one GPU holding ``tokens`` tokens, with uniform routing.

    Of the P − 1 other ranks, ``per_domain`` − 1 share the GPU's NVLink domain; each phase's bytes split in that
    proportion and take max(NVLink bytes / nvlink, network bytes / nic). Latency is left out."""
    near = (per_domain - 1) / (ranks - 1)  # share of the remote traffic that stays in the NVLink domain
    seconds = 0.0
    for phase_bytes in (tokens * dispatch_bytes_per_token(width, k, n, ranks, dedup, dispatch),
                        tokens * remote_slots(k, ranks) * width * 2):
        seconds += max(phase_bytes * near / nvlink, phase_bytes * (1 - near) / nic)
    return seconds
