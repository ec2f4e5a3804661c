"""Chapter 10, the Triton rung: Block AttnRes's depth read as one kernel, forward (the key RMSNorm with K3's learned
key-norm weight, the softmax over the sources). The reference is the package's one-pass kernel; inputs are small
fp32 tensors (the interpreter is slow), with a bf16 case."""

from __future__ import annotations

import torch

from k3course.grading.chapters.ch08_triton import TORCH_MATH
from k3course.grading.registry import Case, Exercise, register
from k3course.kernels.depth_attention import depth_attention_forward, depth_attention_triton
from k3course.layers.residual import depth_attention
from k3course.ops.norm import NORM_EPS


def depth_read_kernel(query, key_weight, sources, eps=NORM_EPS):
    """The reference: h = Σ_i softmax_i(w·(g ⊙ RMSNorm(v_i))) v_i per token, the package's one-pass kernel on the
    folded query w ⊙ g (key_weight g None: no weight). query, key_weight [D]; sources [N, B, T, D] ->
    (h [B, T, D] in the sources' dtype, weights [N, B, T] float32)."""
    folded = query if key_weight is None else query * key_weight
    return depth_attention_forward(folded, sources, eps)


def _inputs(N: int, B: int, T: int, D: int, seed: int, query_scale: float = 1.0, key_weight: bool = True,
            source_scale: float = 1.0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    query = query_scale * torch.randn(D, generator=g)
    weight = 1 + 0.5 * torch.randn(D, generator=g) if key_weight else None
    return query, weight, source_scale * torch.randn(N, B, T, D, generator=g)


def _depth_read_cases() -> list[Case]:
    query, weight, sources = _inputs(4, 2, 3, 24, 1103)
    strided = sources.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)  # [N, B, T, D], D not the last stride
    return [
        Case("3 sources, B = 2, T = 5, D = 20 (not a power of two)", _inputs(3, 2, 5, 20, 1100)),
        Case("no key-norm weight (None)", _inputs(3, 1, 4, 16, 1101, key_weight=False)),
        Case("one source: every weight is 1", _inputs(1, 2, 3, 12, 1102)),
        Case("strided sources (D is not the contiguous axis)", (query, weight, strided)),
        Case("T = 37 tokens: a partial block of tokens", _inputs(3, 1, 37, 16, 1104)),
        Case("a large query: logits in the hundreds (subtract the running max)",
             _inputs(5, 1, 4, 16, 1105, query_scale=80.0)),
        Case("eps = 0.5, not the default, tiny sources (eps inside the square root)",
             _inputs(3, 1, 3, 16, 1106, source_scale=0.05), {"eps": 0.5}),
        Case("K3's nine sources, D = 100", _inputs(9, 1, 2, 100, 1107)),
        Case("zero tokens (T = 0)", _inputs(3, 2, 0, 16, 1108)),
        Case("bf16 sources: h in bf16, the weights still fp32",
             (*_inputs(3, 1, 4, 16, 1109)[:2], _inputs(3, 1, 4, 16, 1109)[2].bfloat16())),
    ]


register(Exercise("10.depth_read_kernel", depth_read_kernel, _depth_read_cases, forbidden=TORCH_MATH, isolate=True,
                  package=(depth_attention_forward, depth_attention_triton, depth_attention), guard_bands=True))
