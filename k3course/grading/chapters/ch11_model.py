"""Chapter 11 (the assembled K3): the layer schedule, one decoder layer in Block AttnRes order, the decode
step's cache write, and the parameter count of the real module tree."""

from __future__ import annotations

import torch

from k3course.accounting import meta_param_count
from k3course.config import K3Config, layer_schedule
from k3course.grading.registry import Case, Exercise, register
from k3course.layers.mla import write_rows
from k3course.model import attnres_decoder_layer


def _schedule_cases() -> list[Case]:
    settings = {"tiny (4 layers, 3:1)": (4, 3, 1), "K3 (93 layers, 3:1)": (93, 3, 1),
                "last layer forced to MLA (10 layers, 3:1)": (10, 3, 2), "1:1": (7, 1, 0),
                "all MLA (ratio 0)": (5, 0, 1), "7:1 with 3 dense layers": (17, 7, 3), "one layer": (1, 3, 1),
                "every layer dense": (6, 2, 6)}
    return [Case(name, args) for name, args in settings.items()]


def _sublayer(weight: torch.Tensor):
    """A stand-in sub-layer x -> tanh(x W): the exercise is about the wiring, not the mixer."""
    def apply(x):
        return torch.tanh(x @ weight)
    return apply


def _rms_norm(weight: torch.Tensor):
    def apply(x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-6)
    return apply


def _layer_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1100)
    cases = []
    for name, (n_outputs, block_size, dtype) in {"first layer": (0, 4, torch.float32),
                                                 "mid-block": (2, 4, torch.float32),
                                                 "a block completes at the mixer": (3, 4, torch.float32),
                                                 "block size 1 (Full AttnRes)": (4, 1, torch.float32),
                                                 "block size 2, deep": (6, 2, torch.float32),
                                                 "float64": (2, 4, torch.float64)}.items():
        d = 8
        randn = lambda *shape, dtype=dtype: torch.randn(*shape, generator=g).to(dtype)
        embedding, outputs = randn(2, 3, d), [randn(2, 3, d) for _ in range(n_outputs)]
        queries = randn(2, d)
        mixer, ffn = _sublayer(randn(d, d) / d**0.5), _sublayer(randn(d, d) / d**0.5)
        norms = _rms_norm(1 + 0.1 * randn(d)), _rms_norm(1 + 0.1 * randn(d))
        cases.append(Case(name, (embedding, outputs, queries, block_size, mixer, ffn, *norms)))
    return cases


def _cache_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1101)
    cases = []
    for name, (capacity, length, new, dtype) in {"one token, room left": (8, 3, 1, torch.float32),
                                                 "prefill into an empty cache": (16, 0, 5, torch.float32),
                                                 "exactly full": (6, 5, 1, torch.float32),
                                                 "one past capacity: doubles": (4, 4, 1, torch.float32),
                                                 "a long chunk: grows to fit": (4, 3, 9, torch.float32),
                                                 "room left, but too little: grows": (8, 6, 3, torch.float32),
                                                 "bf16 cache": (8, 2, 3, torch.bfloat16),
                                                 "bf16 cache that grows": (4, 3, 2, torch.bfloat16)}.items():
        buffer = torch.zeros(2, capacity, 6, dtype=dtype)
        buffer[:, :length] = torch.randn(2, length, 6, generator=g).to(dtype)
        cases.append(Case(name, (buffer, length, torch.randn(2, new, 6, generator=g).to(dtype))))
    return cases


def total_and_active(cfg: K3Config) -> tuple[int, int]:
    """(total, active) parameters of K3Model(cfg), counted on the meta device (bias buffers excluded)."""
    counts = meta_param_count(cfg)
    return counts["total"], counts["active"]


def _count_cases() -> list[Case]:
    tiny = K3Config.preset("tiny")
    return [Case("tiny", (tiny,)), Case("small", (K3Config.preset("small"),)),
            Case("tied embeddings", (tiny.replace(tie_embeddings=True),)),
            Case("no latent, no shared experts", (tiny.replace(latent_dim=None, n_shared_experts=0),)),
            Case("PreNorm (no AttnRes queries)", (tiny.replace(residual="prenorm"),)),
            Case("explicit mla_layers (not the ratio's plan)",
                 (K3Config.preset("small").replace(mla_layers=(0, 1, 2)),)),
            Case("Kimi K3", (K3Config.preset("kimi-k3"),))]


register(Exercise("11.layer_schedule", layer_schedule, _schedule_cases))
register(Exercise("11.decoder_layer", attnres_decoder_layer, _layer_cases))
register(Exercise("11.cache_write", write_rows, _cache_cases, mutable=("buffer",)))
register(Exercise("11.param_count", total_and_active, _count_cases))
