"""Chapter 01, a part of K3 by hand: the shared experts (one fused gated FFN every token passes through)."""

from __future__ import annotations

import torch

from k3course.config import K3Config
from k3course.grading.registry import Backward, Case, Exercise, register
from k3course.moe.experts import GLUFFN, glu_ffn


def shared_expert_case(seed: int, shape: tuple, d: int, hidden: int, activation: str, scale: float = 1.0,
                       dtype=torch.float32) -> tuple:
    """(x [..., d], w_gate, w_up [d, hidden], w_down [hidden, d], activation), seeded, N(0, 1/fan_in) weights."""
    g = torch.Generator().manual_seed(seed)
    weights = (torch.randn(d, hidden, generator=g) / d ** 0.5, torch.randn(d, hidden, generator=g) / d ** 0.5,
               torch.randn(hidden, d, generator=g) / hidden ** 0.5)
    x = scale * torch.randn(*shape, d, generator=g)
    return (x.to(dtype), *(w.to(dtype) for w in weights), activation)


def _cases() -> list[Case]:
    tiny = K3Config.preset("tiny")
    hidden = tiny.n_shared_experts * tiny.expert_dim
    return [Case("the tiny K3's shared expert: SiTU-GLU, [B, T, d] tokens",
                 shared_expert_case(1, (2, 5), tiny.d_model, hidden, tiny.ffn_activation)),
            Case("two shared experts fused into one FFN, SwiGLU, [m, d] tokens",
                 shared_expert_case(2, (9,), 16, 2 * 12, "swiglu")),
            Case("large inputs: SiTU-GLU's caps bite", shared_expert_case(3, (7,), 16, 8, "situ_glu", scale=30.0)),
            Case("bfloat16 weights and tokens keep their dtype", shared_expert_case(4, (3, 4), 16, 8, "situ_glu",
                                                                                    dtype=torch.bfloat16))]


register(Exercise("01.shared_experts", glu_ffn, _cases, tolerance={"float32": (1e-5, 1e-6)}, backward=Backward(),
                  package=(GLUFFN.forward,)))
