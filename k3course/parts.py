"""The model's swappable parts: the few chapter functions a learner may put in place of the package's.

Each part is called at exactly one place in the model, which asks this registry for it::

    route = part("topk_route", topk_route)     # the learner's function while use_parts holds one, else the default
    expert_idx, weights = route(scores, k, bias, renormalize)

where it runs

    topk_route, router_scores   every MoE layer's router (chapter 01)
    shared_experts              every MoE layer's shared experts (chapter 01)
    situ_glu                    every SiTU-GLU of the model: routed, shared and dense FFNs (chapter 02)
    latent_combine              every latent MoE layer's RMSNorm(Σ p E) W↑ (chapter 02)
    quantile_balance_bias       the bias update of quantile balancing, on one process (chapter 03)
    short_conv, kda_gate        every KDA layer's short convolutions and forget gate (chapter 06)
    kda_step                    the recurrent KDA op: decoding, inference on up to a chunk of tokens (chapter 06)
    ut_transform                the chunked KDA op: training, inference on more than a chunk (chapter 07)
    mla_output_gate             every gated MLA layer's output gate (chapter 09)
    kda_chunk                   the whole chunked KDA op, forward only, in place of the torch or Triton one
                                (chapter 08's three kernels, composed by kernels.kda_chunk.kda_chunk_from_kernels)
    grouped_gemm                every routed expert bank's two grouped products, forward only, in place of the
                                loop, torch or Triton one (chapter 08's grouped GEMM kernel)
    depth_attention             every read of the Full / Block AttnRes residual stream (chapter 10)
    all_to_all                  expert-parallel dispatch and combine between ranks (chapter 13)

:func:`use_parts` holds functions for the length of a ``with`` block (process-wide, and always restored); each
must take and return what the package's function of that name does. ``k3course.lessons.parts`` builds the
lesson's comparison of the model with and without them on top of this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

PART_NAMES = ("topk_route", "router_scores", "kda_step", "ut_transform", "depth_attention", "all_to_all",
              "shared_experts", "situ_glu", "latent_combine", "quantile_balance_bias", "short_conv", "kda_gate",
              "mla_output_gate", "kda_chunk", "grouped_gemm")

_in_use: dict[str, Callable] = {}  # part name -> the function use_parts put in place of the package's


def part(name: str, default: Callable) -> Callable:
    """The function the model calls for part ``name``: the one :func:`use_parts` holds, else ``default``."""
    _check_name(name)
    return _in_use.get(name, default)


def is_replaced(name: str) -> bool:
    """Whether :func:`use_parts` holds a function for part ``name`` (a path written for the package's own
    function, such as a closed-form backward, then steps aside)."""
    _check_name(name)
    return name in _in_use


@contextmanager
def use_parts(**functions: Callable) -> Iterator[None]:
    """Inside the block the model calls ``functions[name]`` wherever it would call the package's ``name`` (one of
    :data:`PART_NAMES`); the parts held before the block are held again after it."""
    unknown = sorted(set(functions) - set(PART_NAMES))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; the model's swappable parts are {sorted(PART_NAMES)}")
    for name, fn in functions.items():
        if not callable(fn):
            raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
    before = dict(_in_use)
    _in_use.update(functions)
    try:
        yield
    finally:
        _in_use.clear()
        _in_use.update(before)


def _check_name(name: str) -> None:
    if name not in PART_NAMES:
        raise ValueError(f"name must be one of the swappable parts {PART_NAMES}, got {name!r}")
