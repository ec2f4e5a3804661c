"""Chapter 14 (decoding at long context): bytes a decode step reads, the memory crossover, the roofline TPOT of a
batch (with the experts it touches), TPOT extrapolation."""

from __future__ import annotations

import math

from k3course.accounting import (
    crossover_context,
    decode_usd_per_million,
    kda_step_bytes,
    mla_step_bytes,
    predicted_tpot_s,
)
from k3course.bench.decode import extrapolate_tpot
from k3course.config import K3Config
from k3course.grading.registry import Case, Exercise, register


def _kda_cases() -> list[Case]:
    return [Case("kimi-k3 layer, bf16 tails", (96, 128, 128, 4, 2)), Case("tiny preset, fp32", (4, 32, 32, 4, 4)),
            Case("K != V", (2, 16, 8, 4, 2)), Case("no short conv (conv_size 1)", (3, 8, 8, 1, 2)),
            Case("bf16 state (state_bytes 2)", (2, 8, 8, 4, 2, 2))]


def _mla_cases() -> list[Case]:
    return [Case("kimi-k3 layer at 1M tokens, bf16", (2 ** 20, 512, 64, 2)), Case("tiny preset at 64k, fp32",
            (65536, 32, 16, 4)), Case("empty cache", (0, 32, 16, 2)), Case("no rope dims", (100, 64, 0, 2))]


def _crossover_cases() -> list[Case]:
    tiny, k3 = K3Config.preset("tiny"), K3Config.preset("kimi-k3")
    return [Case("kimi-k3, bf16", (k3, 2)), Case("tiny, fp32", (tiny, 4)), Case("tiny, bf16", (tiny, 2)),
            Case("tiny with 1 KDA per MLA", (tiny.replace(kda_per_mla=1), 4)),
            Case("kimi-linear-48b, bf16", (K3Config.preset("kimi-linear-48b"), 2)),
            Case("the state is a whole number of tokens' growth (exact division)", (tiny.replace(kv_lora_rank=48), 2))]


H200 = (4.8e12, 989e12)  # HBM bytes/s, dense bf16 FLOP/s


def _tpot_cases() -> list[Case]:
    linear, k3, tiny = (K3Config.preset(name) for name in ("kimi-linear-48b", "kimi-k3", "tiny"))
    return [Case("kimi-linear-48b, one sequence at 4k tokens (B = 1 touches k experts)", (linear, 4096, 1, *H200)),
            Case("kimi-linear-48b, 64 sequences at 1M tokens", (linear, 1 << 20, 64, *H200)),
            Case("kimi-linear-48b all-MLA, 16 sequences at 1M tokens", (linear.all_mla(), 1 << 20, 16, *H200)),
            Case("kimi-k3, 256 sequences at 1M tokens (nearly every expert touched)", (k3, 1 << 20, 256, *H200)),
            Case("a FLOP-bound step: kimi-k3 at 1M tokens on a chip of 100 TFLOP/s", (k3, 1 << 20, 64, 4.8e12, 1e14)),
            Case("tiny preset in fp32, 8 sequences", (tiny, 512, 8, 1e11, 1e12, 4)),
            Case("a config without MoE layers (every layer a dense FFN)",
                 (tiny.replace(first_k_dense=tiny.n_layers), 512, 8, 1e11, 1e12, 4)),
            Case("a tied LM head reads the whole embedding table", (tiny.replace(tie_embeddings=True), 512, 8, 1e11,
                                                                   1e13, 4)),
            Case("one embedding row per sequence, not the table: a large batch on a big vocabulary",
                 (linear, 4096, 1000, 4.8e12, 1e18))]


def _price_cases() -> list[Case]:
    return [Case("8 GPUs at $3.60/h, 36 ms steps of 100 tokens", (0.036, 100, 8, 3.6)),
            Case("one GPU, one sequence", (0.02, 1, 1, 2.0)),
            Case("a 64-GPU super node at a large batch", (0.065, 11086, 64, 5.0)),
            Case("an int step time", (1, 10, 2, 4)),
            Case("batch 0 is refused", (0.01, 0, 8, 3.0)),
            Case("a fractional GPU count is refused", (0.01, 4, 1.5, 3.0)),
            Case("a negative price is refused", (0.01, 4, 8, -1.0)),
            Case("a zero step is refused", (0.0, 4, 8, 3.0)),
            Case("a NaN step is refused (NaN > 0 is False)", (math.nan, 4, 8, 3.0)),
            Case("a NaN price is refused", (0.01, 4, 8, math.nan)),
            Case("zero GPUs are refused", (0.01, 4, 0, 3.0)),
            Case("a float batch is refused, even a whole one", (0.01, 4.0, 8, 3.0)),
            Case("a zero price is refused", (0.01, 4, 8, 0.0)),
            Case("a bool batch is refused (True is an int in Python)", (0.01, True, 8, 3.0)),
            Case("a bool price is refused", (0.01, 4, 8, True))]


def _price_or_refusal(answer, *args):
    """The price, or "ValueError" when the answer refuses the input as it must (so refusals are graded too)."""
    try:
        return answer(*args)
    except ValueError:
        return "ValueError"


def _extrapolate_cases() -> list[Case]:
    return [Case("a line", ([1024, 2048, 4096], [0.010, 0.011, 0.013], 1 << 20)),
            Case("noisy points", ([1000, 8000, 16000, 64000], [0.004, 0.009, 0.016, 0.041], 1 << 20)),
            Case("flat (a KDA stack)", ([1024, 65536], [0.006, 0.006], 1 << 20)),
            Case("target inside the range", ([0, 10, 20], [1.0, 3.0, 2.0], 15))]


register(Exercise("14.kda_step_bytes", kda_step_bytes, _kda_cases))
register(Exercise("14.mla_step_bytes", mla_step_bytes, _mla_cases))
register(Exercise("14.crossover_context", crossover_context, _crossover_cases))
register(Exercise("14.predicted_tpot", predicted_tpot_s, _tpot_cases))
register(Exercise("14.extrapolate_tpot", extrapolate_tpot, _extrapolate_cases))
register(Exercise("14.decode_usd_per_million", decode_usd_per_million, _price_cases, harness=_price_or_refusal))
