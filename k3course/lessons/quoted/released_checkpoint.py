"""Chapter 15: what a released checkpoint needs. Each function is a number a lesson quotes (see
:mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

from k3course import accounting
from k3course.config import K3Config
from k3course.lessons.quoted.markers import quoted


@quoted
def pretrained_weights_gib(name: str = "kimi-linear-48b", dtype_bytes: int = 2) -> float:
    """Every weight of the preset stored in ``dtype_bytes``-byte numbers (bf16: 2), GiB."""
    from k3course.lessons import kimi_linear

    return kimi_linear.decode_needs(K3Config.preset(name), dtype_bytes).weight_bytes / 2**30


@quoted
def decode_gflop(name: str = "kimi-linear-48b", context: int = 0) -> float:
    """FLOPs to decode one token at ``context`` cached tokens, GFLOP."""
    return accounting.decode_flops_per_token(K3Config.preset(name), context) / 1e9


@quoted
def decode_read_gib(name: str = "kimi-linear-48b", dtype_bytes: int = 2) -> float:
    """The active weights (embedding row aside) one decoded token reads, GiB."""
    from k3course.lessons import kimi_linear

    return kimi_linear.decode_needs(K3Config.preset(name), dtype_bytes).read_bytes_per_token / 2**30
