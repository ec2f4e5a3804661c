"""Run the real model with your own chapter functions in place of the package's, and see where it departs.

The model asks the registry :mod:`k3course.parts` for a few key functions where it calls them; :func:`use_parts`
puts yours there for the duration of a ``with`` block (and always restores the package's)::

    with use_parts(topk_route=my_topk_route, depth_attention=my_depth_attention):
        logits, _, _ = model(tokens)

:func:`compare` runs the model twice on the same tokens and weights — the package's parts, then yours — and
reports, sub-layer by sub-layer in execution order, how far each output is from the reference, and the first
one that departs.

Where each part runs: ``topk_route`` and ``router_scores`` in every MoE layer; ``ut_transform`` in the chunked
KDA path (training, and inference on more than a chunk of tokens); ``kda_step`` in the recurrent KDA path
(inference on up to a chunk of tokens, i.e. decoding); ``depth_attention`` in every Block AttnRes read;
``kda_chunk`` in place of the whole chunked KDA op (chapter 08's three kernels composed; forward only);
``grouped_gemm`` in every routed expert bank's two grouped products (chapter 08's kernel; forward only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3course.parts import PART_NAMES, use_parts

__all__ = ["PART_NAMES", "Comparison", "Departure", "compare", "use_parts"]


@dataclass(frozen=True)
class Departure:
    """One sub-layer's output under your parts vs the reference: max |Δ| / max |reference|."""

    name: str
    relative_error: float


@dataclass(frozen=True)
class Comparison:
    """Every sub-layer's departure in execution order, then the logits; ``first`` is the earliest above tol."""

    rows: list[Departure]
    tol: float

    @property
    def first(self) -> Departure | None:
        return next((row for row in self.rows if not row.relative_error <= self.tol), None)

    def __str__(self) -> str:
        lines = [f"{row.name:<22} {row.relative_error:9.2e}  {'' if row.relative_error <= self.tol else '<- departs'}"
                 for row in self.rows]
        verdict = ("your parts reproduce the model" if self.first is None
                   else f"first departure: {self.first.name}")
        return "\n".join([*lines, verdict])


def compare(model: torch.nn.Module, tokens: torch.Tensor, tol: float = 1e-4, **functions: Callable) -> Comparison:
    """Run ``model`` on ``tokens`` with the package's parts and with ``functions`` (see :func:`use_parts`) and
    report, for each decoder sub-layer (``layers.i.mixer``, ``layers.i.ffn``) and the logits, the relative
    difference of the outputs. The model runs in eval mode with no gradient; its training flag is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            reference = _sublayer_outputs(model, tokens)
            with use_parts(**functions):
                yours = _sublayer_outputs(model, tokens)
    finally:
        model.train(was_training)
    rows = [Departure(name, _relative_error(yours[name], reference[name])) for name in reference]
    return Comparison(rows, tol)


def _sublayer_outputs(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: output} of every mixer and FFN in execution order, then "logits", from one forward pass."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(model.layers):
        for part in ("mixer", "ffn"):
            name = f"layers.{index}.{part}"
            record = lambda module, args, out, name=name: outputs.__setitem__(
                name, out[0] if isinstance(out, tuple) else out)
            hooks.append(getattr(layer, part).register_forward_hook(record))
    try:
        outputs["logits"] = model(tokens)[0]
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def _relative_error(mine: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max().clamp_min(torch.finfo(reference.dtype).tiny)
    return ((mine - reference).abs().max() / scale).item()
