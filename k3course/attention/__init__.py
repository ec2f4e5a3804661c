"""Token mixers: decay-gated linear attention, Gated DeltaNet and Kimi Delta Attention (recurrent, chunked,
layers), plus gated MLA. Layouts follow fla's (lesson 04).

The names below load lazily (module ``__getattr__``): ``import k3course.attention.chunk`` loads the ops alone,
not the layers (``kda``, ``mla``) nor, through them, the Triton kernels. Layering, bottom up: ``checks`` →
``recurrent``, ``chunk``, ``parallel`` (the ops) → ``k3course.kernels`` (tested against the ops) → ``kda``,
``mla`` (the layers, which call either).
"""

from __future__ import annotations

import importlib

_HOMES = {"gdn_chunk": "chunk", "gla_chunk": "chunk", "kda_chunk": "chunk",
          "gdn_recurrent": "recurrent", "gla_recurrent": "recurrent", "kda_recurrent": "recurrent",
          "decay_attention_parallel": "parallel", "softmax_attention": "parallel",
          "DecayedLinearAttention": "kda", "GatedDeltaNet": "kda", "KDACache": "kda", "KimiDeltaAttention": "kda",
          "GatedMLA": "mla"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    """Load ``name`` from its submodule on first use (``from k3course.attention import kda_chunk``)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'k3course.attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"k3course.attention.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
