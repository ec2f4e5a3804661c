"""The numbers the lessons quote in their text, each computed by the package: where a sentence's number comes from.

A number in a lesson's markdown that comes from a computation stays literal text, right after an invisible
marker (an HTML comment: JupyterLab and GitHub do not show it) that names the computation:

    at 1M tokens the hybrid holds <!--q:k3_cache_gib(1048576)|.1f-->27.4 GiB per sequence

``NAME(ARGS)`` calls the function registered here as ``NAME`` with literal arguments (no arguments: ``NAME``
alone); ``|FMT`` formats the value with Python's format spec (a :class:`Pair` formats both
of its numbers). :func:`check_text` finds every marker in a text and reports each one whose text does not begin
with the formatted value; ``tests/test_quoted_numbers.py`` runs it over every lesson, solution and exercise
notebook and the README. Change a formula, a preset or a saved result and the sentence that quotes it fails.

Numbers a notebook measures or trains while it runs (times, a live training's accuracies) change from machine to
machine: the lessons do not write them into markdown. A cell prints them, or renders its sentence from them
with :func:`say`.

Memory is counted in binary units throughout the course (KiB, MiB, GiB = 2¹⁰, 2²⁰, 2³⁰ bytes); rates
(bandwidths, FLOP/s) in decimal ones (GB/s, TFLOP/s), as hardware is sold.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from k3course import accounting
from k3course.config import PUBLISHED_PARAMS, K3Config
from k3course.distributed import cost
from k3course.lessons import experiments

MARKER = re.compile(r"<!--q:(?P<body>.*?)-->", re.S)
QUOTED: dict[str, Callable] = {}
MILLION = 1 << 20


def quoted(function: Callable) -> Callable:
    """Register ``function`` under its own name: markdown quotes it as ``<!--q:name(args)|fmt-->``."""
    if function.__name__ in QUOTED:
        raise ValueError(f"function: {function.__name__!r} is registered twice")
    QUOTED[function.__name__] = function
    return function


@dataclass(frozen=True)
class Pair:
    """Two numbers written in one format with a separator between them: ``mean ± std`` (:func:`plus_minus`) or
    ``low–high`` (:func:`span`)."""

    first: float
    second: float
    separator: str

    def __format__(self, spec: str) -> str:
        return f"{self.first:{spec}}{self.separator}{self.second:{spec}}"


def plus_minus(mean: float, std: float) -> Pair:
    """``mean ± std``."""
    return Pair(mean, std, " ± ")


def span(low: float, high: float) -> Pair:
    """``low–high``."""
    return Pair(low, high, "–")


# --- markers: parse, evaluate, compare ----------------------------------------------------------------------

@dataclass(frozen=True)
class Mismatch:
    """A marker whose text is not its computation: ``marker`` as written, ``expected`` (formatted), ``found``
    (the text after the marker, as long as ``expected``), or ``error`` when the marker cannot be evaluated."""

    marker: str
    expected: str
    found: str
    error: str = ""

    def __str__(self) -> str:
        if self.error:
            return f"{self.marker}: {self.error}"
        return f"{self.marker} computes {self.expected!r} but the text says {self.found!r}"


def evaluate(body: str) -> str:
    """The text a marker's ``NAME(ARGS)|FMT`` stands for: the registered function's value, formatted."""
    call, _, spec = body.rpartition("|") if "|" in body else (body, "", "")
    tree = ast.parse(call.strip(), mode="eval").body
    if isinstance(tree, ast.Name):
        name, args = tree.id, ()
    elif isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and not tree.keywords:
        name, args = tree.func.id, tuple(ast.literal_eval(arg) for arg in tree.args)
    else:
        raise ValueError(f"a marker is NAME or NAME(literal, ...), got {call!r}")
    if name not in QUOTED:
        raise KeyError(f"no quoted number named {name!r} in k3course.lessons.quoted")
    return format(QUOTED[name](*args), spec)


def normalise(text: str) -> str:
    """Typography that does not change a number: the minus sign, thin and no-break spaces."""
    return text.replace("−", "-").replace("\u2009", " ").replace("\u202f", " ").replace("\xa0", " ")


def check_text(text: str) -> tuple[int, list[Mismatch]]:
    """(markers found, the ones whose text is not their computation) in a markdown ``text``.

    The text right after a marker must start with the formatted value and not continue it with another digit
    (``3.9`` does not match ``3.94``)."""
    mismatches, count = [], 0
    for match in MARKER.finditer(text):
        count += 1
        try:
            expected = normalise(evaluate(match["body"]))
        except Exception as error:  # noqa: BLE001 - any failure to evaluate is reported as a mismatch
            mismatches.append(Mismatch(match[0], "", "", f"{type(error).__name__}: {error}"))
            continue
        after = normalise(text[match.end():])
        found = after[:len(expected)]
        continues = after[len(expected):len(expected) + 2]
        if found != expected or re.match(r"\d|[.,]\d", continues):
            mismatches.append(Mismatch(match[0], expected, after[:len(expected) + 2]))
    return count, mismatches


def say(template: str, **values) -> None:
    """Show ``template`` (markdown) with ``values`` filled in, as a cell's output: a sentence about numbers this
    run computed (``say("GDN recalls {acc:.0%}", acc=0.95)``)."""
    from IPython.display import Markdown, display

    display(Markdown(template.format(**values)))


# --- chapter 00 and the README: K3's size and sparsity --------------------------------------------------------

@functools.cache
def _count(name: str) -> accounting.ParamCount:
    return accounting.param_count(K3Config.preset(name))


def _k3() -> K3Config:
    return K3Config.preset("kimi-k3")


@quoted
def total_params_t(name: str = "kimi-k3") -> float:
    """A preset's total parameters, in trillions."""
    return _count(name).total / 1e12


@quoted
def total_params_b(name: str = "kimi-k3") -> float:
    """A preset's total parameters, in billions."""
    return _count(name).total / 1e9


@quoted
def active_params_b(name: str = "kimi-k3") -> float:
    """A preset's active parameters per token, in billions."""
    return _count(name).active / 1e9


@quoted
def total_params_m(name: str) -> float:
    """A preset's total parameters, in millions."""
    return _count(name).total / 1e6


@quoted
def active_params_m(name: str) -> float:
    """A preset's active parameters per token, in millions."""
    return _count(name).active / 1e6


@quoted
def published_gap(name: str, which: str) -> float:
    """Our count over the published one, minus 1, for ``which`` = "total" or "active"."""
    count, (total, active) = _count(name), PUBLISHED_PARAMS[name]
    return count.total / total - 1 if which == "total" else count.active / active - 1


@quoted
def published_missing_b(name: str) -> float:
    """Published total minus our count, in billions (what the published dimensions leave unexplained)."""
    return (PUBLISHED_PARAMS[name][0] - _count(name).total) / 1e9


@quoted
def published_b(name: str, which: str) -> float:
    """The published total or active parameters, in billions."""
    total, active = PUBLISHED_PARAMS[name]
    return (total if which == "total" else active) / 1e9


@quoted
def component_b(name: str, component: str, which: str = "total") -> float:
    """One component's parameters (total or active), in billions."""
    total, active = _count(name).components[component]
    return (total if which == "total" else active) / 1e9


@quoted
def active_without_b(name: str, *components: str) -> float:
    """Active parameters without the named components (e.g. the embedding), in billions."""
    count = _count(name)
    return (count.active - sum(count.components[c][1] for c in components)) / 1e9


@quoted
def component_share(name: str, component: str, which: str = "total") -> float:
    """A component's share of the total (or of the active) parameters."""
    count = _count(name)
    total, active = count.components[component]
    return total / count.total if which == "total" else active / count.active


@quoted
def active_fraction(name: str = "kimi-k3") -> float:
    """Active over total parameters."""
    return _count(name).active / _count(name).total


@quoted
def activation_ratio(name: str = "kimi-k3") -> float:
    """Routed experts active per token over routed experts (top_k / n_routed_experts)."""
    return accounting.activation_ratio(K3Config.preset(name))


@quoted
def expert_ratio_over(name: str, other: str) -> float:
    """How many times ``name``'s routed experts outnumber ``other``'s."""
    return K3Config.preset(name).n_routed_experts / K3Config.preset(other).n_routed_experts


@quoted
def k3_uncertain_params_b() -> float:
    """What our K3 preset had to assume, in billions: the dense layer's FFN, KDA's low-rank forget-gate
    projections (with A_log and dt_bias), and the norms and AttnRes queries."""
    cfg = _k3()
    gate = accounting._linear(cfg.d_model, cfg.kda_head_dim) + accounting._linear(
        cfg.kda_head_dim, cfg.kda_n_heads * cfg.kda_head_dim) + cfg.kda_n_heads * (1 + cfg.kda_head_dim)
    parts = _count("kimi-k3").components
    return (parts["dense_ffn"][0] + cfg.n_kda_layers * gate + parts["norms_and_residual"][0]) / 1e9


@quoted
def k3_uncertain_share() -> float:
    """The assumed parameters (:func:`k3_uncertain_params_b`) over K3's total."""
    return k3_uncertain_params_b() * 1e9 / _count("kimi-k3").total


@quoted
def layers(name: str, kind: str) -> int:
    """A preset's number of layers of one kind: "kda", "mla", "moe", "dense" or "all"."""
    cfg = K3Config.preset(name)
    return {"kda": cfg.n_kda_layers, "mla": cfg.n_mla_layers, "moe": cfg.n_moe_layers,
            "dense": cfg.first_k_dense, "all": cfg.n_layers}[kind]


@quoted
def layer_share(name: str, kind: str) -> float:
    """The share of a preset's layers of one kind ("kda", "mla", ...)."""
    return layers(name, kind) / layers(name, "all")


@quoted
def latent_expert_saving() -> float:
    """How many times more routed-expert parameters K3 would have with full-width experts (ℓ = d)."""
    cfg = _k3()
    return cfg.d_model / cfg.latent_dim


# --- decoding memory and compute (chapters 00, 09, 14) ----------------------------------------------------------

@quoted
def mla_cache_numbers(name: str = "kimi-k3") -> int:
    """Numbers an MLA layer caches per token: kv_lora_rank + rope."""
    cfg = K3Config.preset(name)
    return accounting.mla_cache_numbers(cfg.kv_lora_rank, cfg.qk_rope_head_dim)


@quoted
def cache_gib(name: str, context: int, schedule: str = "hybrid", dtype_bytes: int = 2) -> float:
    """Decoding memory of one sequence, GiB: the preset as it is ("hybrid") or with every layer MLA."""
    cfg = K3Config.preset(name)
    cfg = cfg.all_mla() if schedule == "all-mla" else cfg
    return accounting.kv_cache_bytes(cfg, context, dtype_bytes) / 2**30


@quoted
def cache_saving(name: str = "kimi-k3", context: int = MILLION) -> float:
    """1 − hybrid / all-MLA decoding memory at ``context`` tokens."""
    cfg = K3Config.preset(name)
    return 1 - accounting.kv_cache_bytes(cfg, context) / accounting.kv_cache_bytes(cfg.all_mla(), context)


@quoted
def cache_ratio(name: str = "kimi-k3", context: int = MILLION) -> float:
    """All-MLA over hybrid decoding memory at ``context`` tokens."""
    return 1 / (1 - cache_saving(name, context))


@quoted
def saving_ceiling(name: str = "kimi-k3") -> float:
    """The largest saving of the per-token growth: 1 − MLA layers / layers."""
    cfg = K3Config.preset(name)
    return 1 - cfg.n_mla_layers / cfg.n_layers


@quoted
def state_mib(name: str = "kimi-k3", dtype_bytes: int = 2) -> float:
    """The KDA states and conv tails of one sequence (fp32 states), MiB."""
    return accounting.recurrent_state_bytes(K3Config.preset(name), dtype_bytes) / 2**20


@quoted
def crossover(name: str = "kimi-k3", dtype_bytes: int = 2) -> int:
    """The shortest context at which the hybrid holds less decoding memory than all-MLA."""
    return accounting.crossover_context(K3Config.preset(name), dtype_bytes)


@quoted
def decode_flops_ratio(context: int = MILLION) -> float:
    """All-MLA over hybrid decode FLOPs per token for K3 at ``context`` tokens."""
    cfg = _k3()
    return accounting.decode_flops_per_token(cfg.all_mla(), context) / accounting.decode_flops_per_token(cfg, context)


H200 = (4.8e12, 989e12)  # HBM bytes/s, dense bf16 FLOP/s: the roofline lessons 08 and 14 assume
H200_MEMORY = 141e9  # bytes of HBM on one H200 (assumed, lesson 14)


@quoted
def roofline_tpot_ratio(batch: int, context: int = MILLION, name: str = "kimi-k3") -> float:
    """All-MLA over hybrid roofline TPOT on an H200 at ``context`` tokens and ``batch`` sequences."""
    cfg = K3Config.preset(name)
    return (accounting.predicted_tpot_s(cfg.all_mla(), context, batch, *H200)
            / accounting.predicted_tpot_s(cfg, context, batch, *H200))


def _schedule(name: str, schedule: str) -> K3Config:
    cfg = K3Config.preset(name)
    return cfg.all_mla() if schedule == "all-mla" else cfg


@quoted
def max_batch(name: str, schedule: str = "hybrid", context: int = MILLION) -> int:
    """Sequences of ``context`` tokens one H200's memory holds beside the weights (bf16)."""
    return accounting.max_decode_batch(_schedule(name, schedule), context, H200_MEMORY)


@quoted
def capacity_throughput_ratio(name: str = "kimi-linear-48b", context: int = MILLION) -> float:
    """Hybrid over all-MLA roofline throughput (tokens/s) on one H200, each at the largest batch its memory holds."""
    def throughput(cfg: K3Config) -> float:
        batch = accounting.max_decode_batch(cfg, context, H200_MEMORY)
        return batch / accounting.predicted_tpot_s(cfg, context, batch, *H200)
    cfg = K3Config.preset(name)
    return throughput(cfg) / throughput(cfg.all_mla())


@quoted
def tpot_ms(name: str, context: int, batch: int, schedule: str = "hybrid") -> float:
    """Roofline TPOT on one H200, ms."""
    return accounting.predicted_tpot_s(_schedule(name, schedule), context, batch, *H200) * 1e3


@quoted
def weights_gib(name: str = "kimi-linear-48b", dtype_bytes: int = 2) -> float:
    """The whole model's weights, GiB."""
    return accounting.param_count(K3Config.preset(name)).total * dtype_bytes / 2**30


@quoted
def prefill_ratio(name: str = "kimi-linear-48b", context: int = MILLION) -> float:
    """All-MLA over hybrid prefill FLOPs for one sequence of ``context`` tokens."""
    cfg = K3Config.preset(name)
    return accounting.prefill_flops(cfg.all_mla(), context) / accounting.prefill_flops(cfg, context)


@quoted
def experts_touched(name: str, batch: int) -> float:
    """Routed experts of one MoE layer that a decode step of ``batch`` tokens runs, on average (uniform routing)."""
    cfg = K3Config.preset(name)
    return accounting.experts_touched(cfg.n_routed_experts, cfg.top_k, batch)


@quoted
def h200_balance() -> float:
    """FLOPs per byte at which an H200 turns from memory-bound to compute-bound."""
    return H200[1] / H200[0]


@quoted
def kda_step_flops_per_byte() -> float:
    """FLOPs per byte one K3 KDA layer's decode step does (7·H·K·V over its state and conv tails)."""
    cfg = _k3()
    nbytes = accounting.kda_step_bytes(cfg.kda_n_heads, cfg.kda_head_dim, cfg.kda_head_dim, cfg.kda_conv_size, 2)
    return 7 * cfg.kda_n_heads * cfg.kda_head_dim ** 2 / nbytes


@quoted
def mla_step_flops_per_byte() -> float:
    """FLOPs per byte of K3's absorbed MLA decode step (any context: both are linear in it)."""
    cfg = _k3()
    flops = 2 * cfg.mla_n_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return flops / accounting.mla_step_bytes(1, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 2)


@quoted
def mla_over_kda_step_bytes(context: int = MILLION) -> float:
    """Bytes one K3 MLA layer's decode step reads at ``context`` over one KDA layer's (bf16 cache, fp32 state)."""
    cfg = _k3()
    kda = accounting.kda_step_bytes(cfg.kda_n_heads, cfg.kda_head_dim, cfg.kda_head_dim, cfg.kda_conv_size, 2)
    return accounting.mla_step_bytes(context, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 2) / kda


@quoted
def a2a_bytes_per_token(name: str = "kimi-k3") -> int:
    """The bytes one token sends and gets back per MoE layer in bf16: 2 · top_k · width · 2 (width ℓ, or d)."""
    cfg = K3Config.preset(name)
    return 2 * cfg.top_k * (cfg.latent_dim or cfg.d_model) * 2


# --- chapter 09: one MLA layer ------------------------------------------------------------------------------

@quoted
def mla_layer_params_m(name: str = "kimi-k3") -> float:
    """One gated MLA layer's parameters, in millions."""
    return accounting.mla_layer_params(K3Config.preset(name)) / 1e6


@quoted
def mla_gate_params_m() -> float:
    """K3's MLA output gate (d × H·d_v), in millions of parameters."""
    cfg = _k3()
    return cfg.d_model * cfg.mla_n_heads * cfg.v_head_dim / 1e6


def _per_token_numbers(scheme: str) -> int:
    cfg = _k3()
    return {"mha": accounting.mha_cache_numbers(cfg.mla_n_heads, 128),
            "gqa": accounting.gqa_cache_numbers(8, 128, n_heads=cfg.mla_n_heads),
            "mla": accounting.mla_cache_numbers(cfg.kv_lora_rank, cfg.qk_rope_head_dim)}[scheme]


@quoted
def cache_shrink(big: str, small: str) -> float:
    """Per-token cache of ``big`` over ``small`` ("mha", "gqa", "mla"), K3's heads (GQA: 8 key-value heads)."""
    return _per_token_numbers(big) / _per_token_numbers(small)


@quoted
def all_layers_cache_gib(scheme: str, context: int = MILLION) -> float:
    """``scheme`` ("mha", "gqa", "mla") in all of K3's layers: one sequence's cache at ``context``, GiB (bf16)."""
    return context * _per_token_numbers(scheme) * 2 * _k3().n_layers / 2**30


@quoted
def all_layers_cache_tib(scheme: str, context: int = MILLION) -> float:
    """The same in TiB."""
    return all_layers_cache_gib(scheme, context) / 2**10


@quoted
def absorbed_ratio(context: int = MILLION, size: str = "k3") -> float:
    """Naive over absorbed multiply-adds of one MLA decode step ("k3" sizes, or lesson 09's "mid" layer)."""
    dims = (dict(n_heads=96, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
            if size == "k3" else dict(n_heads=16, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                      v_head_dim=32))
    return (accounting.decode_step_flops(context, absorbed=False, **dims)
            / accounting.decode_step_flops(context, absorbed=True, **dims))


@quoted
def absorbed_slope_ratio(size: str = "k3") -> float:
    """The ratio of the two per-token slopes, (d_nope + d_v)·r / (2r + d_rope)."""
    r, nope, rope, v = (512, 128, 64, 128) if size == "k3" else (128, 32, 16, 32)
    return (nope + v) * r / (2 * r + rope)


# --- chapter 02: latent MoE ------------------------------------------------------------------------------

@quoted
def expert_work_vs_projections(which: str) -> int:
    """K3's per-token routed-expert width K·3h ("experts") against the projections' 2d ("projections")."""
    cfg = _k3()
    return cfg.top_k * 3 * cfg.expert_dim if which == "experts" else 2 * cfg.d_model


# --- chapter 03: the sampling floor of balancing on fresh batches ------------------------------------------------

@quoted
def quota(m: int = 4096, n: int = 64, k: int = 4) -> int:
    """An expert's fair share of m tokens' k choices over n experts: ⌊m·k/n⌋ token-slots."""
    return m * k // n


@quoted
def quota_sd(m: int = 4096, n: int = 64, k: int = 4) -> float:
    """The standard deviation of one expert's load around its quota, ≈ √q (a Poisson-like count)."""
    return math.sqrt(quota(m, n, k))


@quoted
def expected_max_normal(count: int = 64) -> float:
    """E[max of ``count`` independent standard normals], by numerical integration."""
    step, total, x = 1e-3, 0.0, -10.0
    while x < 10.0:
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * count * cdf ** (count - 1) * pdf * step
        x += step
    return total


@quoted
def sampling_floor(batches: int = 1, m: int = 4096, n: int = 64, k: int = 4) -> float:
    """The max-violation left by sampling noise: the largest of n loads sits E[max z]·√(batches·q) above q,
    relative to q (``batches`` = 2 when the bias carries its own batch's noise too)."""
    q = quota(m, n, k)
    return expected_max_normal(n) * math.sqrt(batches * q) / q


@quoted
def histogram_kib(n: int = 64, bins: int = 256, count_bytes: int = 8) -> float:
    """The per-expert margin histograms one all-reduce sums (int64 counters, as ``torch.bincount`` returns), KiB."""
    return n * bins * count_bytes / 2**10


# --- chapter 05: recall without training ---------------------------------------------------------------------

PAIR_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 48)  # lesson 05's table


@quoted
def pair_recall(rule: str, n_pairs: int, beta: float = 1.0) -> float:
    """Lesson 05's recall error after writing ``n_pairs`` pairs (``decay_tasks.pair_recall_error``)."""
    from k3course.lessons.decay_tasks import pair_recall_error

    return pair_recall_error(rule, n_pairs, beta=beta)


@quoted
def pair_recall_best_from(beta: float = 0.5) -> int:
    """The pair count of lesson 05's table from which the delta rule with step ``beta`` has the lowest error of the
    three rules at every larger count."""
    def best(n: int) -> bool:
        mine = pair_recall("delta rule", n, beta)
        return mine < min(pair_recall("linear attention", n), pair_recall("delta rule", n))

    return next(n for i, n in enumerate(PAIR_COUNTS) if all(best(m) for m in PAIR_COUNTS[i:]))


# --- chapter 11 -------------------------------------------------------------------------------------------

@quoted
def attnres_layers_per_block(name: str = "kimi-k3") -> int:
    """Decoder layers per Block AttnRes block (two sub-layers each)."""
    return K3Config.preset(name).attnres_block_size // 2


@quoted
def attnres_blocks(name: str = "kimi-k3") -> int:
    """Block AttnRes blocks over the model's 2·n_layers sub-layers."""
    cfg = K3Config.preset(name)
    return math.ceil(2 * cfg.n_layers / cfg.attnres_block_size)


@quoted
def embedding_and_head_b(name: str = "kimi-k3") -> float:
    """The input embedding and the LM head together, in billions."""
    parts = _count(name).components
    return (parts["embedding"][0] + parts["lm_head"][0]) / 1e9


@quoted
def uniform_loss(vocab: int = 256) -> float:
    """The loss of a uniform guess over ``vocab`` tokens, ln vocab (nats)."""
    return math.log(vocab)


# --- chapter 13: expert parallelism ----------------------------------------------------------------------------

@quoted
def ranks_holding(n: int, ranks: int, size: str) -> int:
    """How many of ``ranks`` hold the larger ("big") or smaller ("small") block of ``n`` experts."""
    big = n % ranks
    return big if size == "big" else ranks - big


@quoted
def block_size(n: int, ranks: int, size: str) -> int:
    """Experts per rank in the larger ("big") or smaller ("small") block."""
    return n // ranks + (1 if size == "big" else 0)


@quoted
def latent_row_kib(dtype_bytes: int = 2) -> float:
    """One K3 token's latent row (ℓ numbers), KiB."""
    return _k3().latent_dim * dtype_bytes / 2**10


@quoted
def ep_ranks_reached(n: int = 896, k: int = 16, ranks: int = 64) -> float:
    """Other ranks a token's k experts land on, on average (uniform routing)."""
    return cost.expected_ranks_reached(n, k, ranks)


@quoted
def ep_remote_slots(k: int = 16, ranks: int = 64) -> float:
    """Token-slots that leave their rank, on average: k·(P − 1)/P."""
    return cost.remote_slots(k, ranks)


@quoted
def ep_network_rows(cluster: str = "SuperNode (64)", part: str = "network") -> int:
    """Of a GPU's P − 1 other ranks in ``cluster``, how many sit outside its NVLink domain ("network"), or all."""
    ranks, per_domain = cost.CLUSTERS[cluster]
    return ranks - per_domain if part == "network" else ranks - 1


@quoted
def ep_cluster_slowdown(width: str = "latent", dedup: bool = False, dispatch: str = "bf16") -> float:
    """K3's all-to-all time on the 64-GPU SuperNode over the 8-GPU node (4096 tokens per GPU, uniform routing)."""
    cfg = _k3()
    columns = cfg.latent_dim if width == "latent" else cfg.d_model
    seconds = {name: cost.all_to_all_seconds(4096, columns, cfg.top_k, cfg.n_routed_experts, ranks, per_domain,
                                             dedup, dispatch)
               for name, (ranks, per_domain) in cost.CLUSTERS.items()}
    return seconds["SuperNode (64)"] / seconds["DGX B300 (8)"]


@quoted
def ep_dedup_saving(part: str = "dispatch", ranks: int = 64) -> float:
    """What deduplication saves of K3's latent bf16 dispatch ("dispatch") or dispatch + combine ("all")."""
    cfg = _k3()
    args = (cfg.latent_dim, cfg.top_k, cfg.n_routed_experts, ranks)
    measure = cost.dispatch_bytes_per_token if part == "dispatch" else cost.bytes_per_token
    return 1 - measure(*args, dedup=True) / measure(*args, dedup=False)


@quoted
def ep_replicated_crossover(name: str = "kimi-k3") -> int:
    """The smallest EP degree at which a rank's block of routed experts weighs less than the replicated weights."""
    cfg = K3Config.preset(name)
    return next(p for p in range(1, cfg.n_routed_experts + 1)
                if cost.weight_bytes_per_rank(cfg, p)["experts"] < cost.weight_bytes_per_rank(cfg, p)["replicated"])


@quoted
def ep_fp8_dispatch_share() -> float:
    """fp8 dispatch bytes (with scales) over bf16's."""
    return cost.FP8_VALUE_BYTES / 2


# --- chapter 12: the saved experiments -------------------------------------------------------------------------

@functools.cache
def _saved(name: str) -> dict:
    return experiments.load(name)


# the claims whose per-run metrics include the max-violation over the last 20 steps ("max_violation_last20")
_LATE_VIOLATION = ("balancing", "expert-count")


@functools.cache
def _result(name: str) -> dict:
    """A saved claim's result as its verdicts read it: the MQAR sweep's chosen cell (runs keyed by "mixer"); the
    balancing claims with each run's max-violation averaged over its last 20 steps ("max_violation_last20")."""
    result = _saved(name)["result"]
    if name == "mqar-sweep":
        return experiments.sweep_comparison(result)
    return experiments.last_steps_mean(result, "max_violation", 20) if name in _LATE_VIOLATION else result


def _key(name: str) -> str:
    return "mixer" if name == "mqar-sweep" else "variant"


def _values(name: str, variant: str, metric: str) -> list[float]:
    result = _result(name)
    values = [run[metric] for run in result["runs"] if run[_key(name)] == variant]
    if not values:
        raise KeyError(f"{name} has no runs of {variant!r}")
    return values


@quoted
def claim(name: str, variant: str, metric: str = "val_bpb") -> Pair:
    """mean ± sample std over the seeds of a saved claim's variant (``experiments.spread``)."""
    row = experiments.spread(_result(name), metric, _key(name))[variant]
    return plus_minus(row["mean"], row["std"])


@quoted
def claim_stat(name: str, variant: str, metric: str, stat: str) -> float:
    """One of "mean", "std", "min", "max" over the seeds of a saved claim's variant."""
    return experiments.spread(_result(name), metric, _key(name))[variant][stat]


@quoted
def claim_range(name: str, variant: str, metric: str = "val_bpb") -> Pair:
    """min–max over the seeds of a saved claim's variant."""
    values = _values(name, variant, metric)
    return span(min(values), max(values))


def _paired(name: str, better: str, worse: str, metric: str) -> dict:
    """:func:`k3course.lessons.experiments.paired` of a saved claim (accuracy: higher is better)."""
    return experiments.paired(_result(name), better, worse, metric, _key(name),
                              higher_is_better=metric == "accuracy")


@quoted
def claim_paired(name: str, better: str, worse: str, metric: str = "val_bpb") -> Pair:
    """min–max over the seeds of the paired difference of a saved claim (``worse`` − ``better``; for accuracy
    ``better`` − ``worse``)."""
    differences = _paired(name, better, worse, metric)["differences"].values()
    return span(min(differences), max(differences))


@quoted
def claim_paired_mean(name: str, better: str, worse: str, metric: str = "val_bpb") -> Pair:
    """Mean ± sample std over the seeds of the paired difference of a saved claim."""
    comparison = _paired(name, better, worse, metric)
    return plus_minus(comparison["mean"], comparison["std"])


@quoted
def claim_pair_spread(name: str, better: str, worse: str, metric: str = "val_bpb") -> float:
    """The seed-to-seed spread the paired mean must exceed: the larger of the two variants' sample std."""
    return _paired(name, better, worse, metric)["spread"]


@quoted
def claim_agreeing_seeds(name: str, better: str, worse: str, metric: str = "val_bpb") -> str:
    """``agreeing/seeds``: the seeds in which ``better`` beat ``worse``."""
    comparison = _paired(name, better, worse, metric)
    return f"{comparison['agreeing']}/{comparison['seeds']}"


@quoted
def claim_verdict(name: str, better: str, worse: str, metric: str = "val_bpb") -> str:
    """"reproduced", "reversed" or "undecided" by chapter 12's rule (:func:`k3course.lessons.experiments.paired`)."""
    return _paired(name, better, worse, metric)["verdict"]


@quoted
def claim_fact(name: str, variant: str, fact: str) -> float:
    """A variant's saved description: "active_params", "total_params", "moe_flops_per_token", ..."""
    return _saved(name)["result"]["variants"][variant][fact]


@quoted
def claim_fact_gap(name: str, variant: str, other: str, fact: str) -> float:
    """``variant``'s saved fact minus ``other``'s."""
    return claim_fact(name, variant, fact) - claim_fact(name, other, fact)


@quoted
def claim_fact_ratio(name: str, variant: str, other: str, fact: str) -> float:
    """``variant``'s saved fact over ``other``'s."""
    return claim_fact(name, variant, fact) / claim_fact(name, other, fact)


@quoted
def claim_minutes(name: str) -> Pair:
    """The shortest and the longest saved run of a claim, in minutes (one thread each)."""
    seconds = [run["seconds"] for run in _saved(name)["result"]["runs"]]
    return span(min(seconds) / 60, max(seconds) / 60)


@quoted
def solved_seeds(name: str, variant: str, threshold: float = 0.9) -> str:
    """``solved/seeds``: the seeds of a saved MQAR variant whose accuracy is above ``threshold``."""
    values = _values(name, variant, "accuracy")
    return f"{sum(v > threshold for v in values)}/{len(values)}"


@quoted
def claim_cpu_hours(*names: str) -> float:
    """CPU-hours the saved claims (or the MQAR sweep) ``names`` took to train together: their runs' seconds summed
    (:func:`k3course.lessons.experiments.cpu_seconds`; one thread per run)."""
    return sum(experiments.cpu_seconds(_saved(name)["result"]) for name in names) / 3600


@quoted
def claim_cpu_minutes(name: str) -> float:
    """The same in CPU-minutes."""
    return claim_cpu_hours(name) * 60


@quoted
def sweep_chosen(field: str) -> int:
    """The saved MQAR sweep's chosen cell: its "steps", "n_pairs" or "head_dim"."""
    result = _saved("mqar-sweep")["result"]
    return result["cells"][result["chosen"]][field]


@quoted
def sweep_cells_tried() -> int:
    """How many cells the saved MQAR sweep trained before it stopped (the chosen one included)."""
    return len(_saved("mqar-sweep")["result"]["cells"])


@quoted
def gpu_over_default(what: str = "bytes") -> float:
    """The GPU budget (``experiments.GPU_TEXT_TRAIN``) over the default run's, per claim run: "bytes" trained,
    "steps" or "batch" (bytes per step)."""
    from k3course.lessons import claims

    gpu, default = experiments.GPU_TEXT_TRAIN, claims.DEFAULT_TEXT_TRAIN
    per_step = lambda settings: settings.batch_size * settings.seq_len
    ratios = {"steps": gpu.steps / default.steps, "batch": per_step(gpu) / per_step(default)}
    return ratios[what] if what in ratios else ratios["steps"] * ratios["batch"]


@quoted
def gpu_budget_hours() -> float:
    """GPU-hours of the four GPU-budget claims in one process, from the step times measured on an H200
    (``results/gpu_budget.json``, :func:`k3course.lessons.experiments.gpu_budget_hours`)."""
    return experiments.gpu_budget_hours(experiments.gpu_step_ms(), experiments.GPU_TEXT_TRAIN)


@quoted
def gpu_step_ms(claim: str, variant: str) -> float:
    """A GPU-budget variant's training step on the H200, ms (``results/gpu_budget.json``)."""
    return experiments.gpu_step_ms()[claim][variant]


@quoted
def violation_first_step() -> Pair:
    """Max-violation at step 1 across every saved balancing run."""
    firsts = [run["max_violation"][0] for run in _saved("balancing")["result"]["runs"]]
    return span(min(firsts), max(firsts))


@quoted
def violation_possible(n_experts: int, k: int = 2) -> float:
    """The largest max-violation top-k of n can reach (every token picks the same k): n/k − 1."""
    return n_experts / k - 1


@quoted
def sign_rule_reach(steps: int = 120, gamma: float = 1e-3) -> float:
    """How far the sign rule can move a bias in ``steps`` steps of ``gamma``."""
    return steps * gamma


@quoted
def train_bytes(which: str = "claims") -> float:
    """Bytes a run trains on: "claims" (TEXT_TRAIN) or "default" (the 800-step tiny-default), in kB or MB."""
    from k3course.lessons import claims
    from k3course.train import train_preset

    settings = claims.TEXT_TRAIN if which == "claims" else train_preset("tiny")[1]
    nbytes = settings.steps * settings.batch_size * settings.seq_len
    return nbytes / 1e3 if which == "claims" else nbytes / 1e6


@quoted
def epoch_fraction(which: str = "claims") -> float:
    """The share of one pass over the saved corpus's training split that a run reads."""
    splits = _saved("tiny-default")["result"]["corpus"]["splits"]
    scale = 1e3 if which == "claims" else 1e6
    return train_bytes(which) * scale / splits["train"]["bytes"]


@quoted
def default_over_claims() -> float:
    """How many times more bytes the 800-step default run reads than a claim run."""
    return train_bytes("default") * 1e6 / (train_bytes("claims") * 1e3)


@quoted
def default_val_bpb(step: int = 800) -> float:
    """The saved default run's validation bits/byte at ``step``."""
    return next(r["val_bpb"] for r in _saved("tiny-default")["result"]["metrics"] if r["step"] == step
                and "val_bpb" in r)


@quoted
def default_baseline(name: str) -> float:
    """A baseline (unigram, bigram, trigram, lzma-9) of the saved default run's split, bits/byte."""
    return _saved("tiny-default")["result"]["baselines"][name]


@quoted
def default_bytes_per_s() -> float:
    """The median training throughput of the saved default run, bytes (= tokens) per second."""
    speeds = sorted(r["tokens_per_s"] for r in _saved("tiny-default")["result"]["metrics"])
    return speeds[len(speeds) // 2]


@quoted
def default_minutes() -> float:
    """Wall minutes of the saved default run (training and its evaluations)."""
    return _saved("tiny-default")["result"]["train_seconds"] / 60


@quoted
def default_violation(which: str) -> float:
    """The saved default run's max-violation: "first" step, or the median of the "last100"."""
    violations = [r["max_violation"] for r in _saved("tiny-default")["result"]["metrics"]]
    return violations[0] if which == "first" else sorted(violations[-100:])[50]


@quoted
def expert_slots(n_experts: int = 112, what: str = "step") -> float:
    """Token-slots one of ``n_experts`` gets per claim step ("step") or over the run ("run"), top-2, uniform."""
    from k3course.lessons import claims

    settings = claims.TEXT_TRAIN
    per_step = settings.batch_size * settings.seq_len * 2 / n_experts
    return per_step if what == "step" else per_step * settings.steps


# --- chapter 14: the saved decode benchmark ------------------------------------------------------------------

@functools.cache
def _decode_bench() -> dict:
    return json.loads((experiments.RESULTS / "decode_bench.json").read_text())


@quoted
def decode_slope_ratio(schedule: str = "hybrid 3:1", batch: int = 1, statistic: str = "median") -> float:
    """The saved decode benchmark's TPOT slope of ``schedule`` over all-MLA's."""
    return _decode_bench()["slopes"][str(batch)][statistic]["over_all_mla"][schedule]


# --- chapter 12: the saved training-step benchmark ------------------------------------------------------------

@functools.cache
def _train_bench() -> dict:
    return json.loads((experiments.RESULTS / "train_bench.json").read_text())


@quoted
def train_step_ratio(mode: str = "eager") -> float:
    """The saved ``bench train``: the tiny K3's training step time over its dense baseline's, ``mode`` "eager" or
    "compiled" (= how many more steps the dense model takes in the same wall time)."""
    return _train_bench()["ratios"]["tiny"][f"K3 / dense, {mode}"]


@quoted
def compile_speedup(model: str = "tiny") -> float:
    """The saved ``bench train``: ``model``'s eager step time over its compiled step time."""
    return 1 / _train_bench()["ratios"]["tiny"][f"{model} compiled / eager"]


# --- chapter 15: what a released checkpoint needs ------------------------------------------------------------

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


@quoted
def claim_equal_time_steps(name: str) -> int:
    """Steps the faster variant of a saved equal-time claim took in the slower one's wall time."""
    saved = _saved(name)
    faster = saved["settings"]["equal_time"][1]
    return next(run["steps"] for run in saved["result"]["runs"]
                if run["variant"] == experiments.equal_time_label(faster))


# --- lesson 14: the published 6.3× against the roofline; what a token costs ---------------------------------

KIMI_LINEAR_TPOT_SPEEDUP = 6.3  # Kimi Linear's published TPOT speed-up over full attention at 1M tokens (†)


@quoted
def published_tpot_gap(against: str = "tpot") -> float:
    """The published 6.3× over the roofline's ratio on Kimi Linear 48B at 1M tokens: ``against`` "tpot" (equal
    batch) or "throughput" (each schedule at the batch its memory holds)."""
    ratio = roofline_tpot_ratio(1, MILLION, "kimi-linear-48b") if against == "tpot" else capacity_throughput_ratio()
    return KIMI_LINEAR_TPOT_SPEEDUP / ratio


# The seeds' deployment of K3 and its list price: weights on "nearly six GPUs in Nvidia DGX B300" at lower
# precision, a "super node of 64 GPUs", "$3 per million input tokens and $15 per million output tokens".
K3_LIST_USD_PER_MILLION = {"input": 3.0, "output": 15.0}
B300_USD_PER_GPU_HOUR = 5.0  # the course's assumption: a rented B300, late 2026 (†)


@quoted
def k3_serving(field: str, precision: str = "int4", gpus: int | None = 64, batch: int | None = None,
               context: int = 32768) -> float:
    """A field of :func:`k3course.accounting.serving_cost` for K3 on B300s at the assumed price (50 % utilisation)."""
    cost = accounting.serving_cost(K3Config.preset("kimi-k3"), "B300", precision, B300_USD_PER_GPU_HOUR, gpus,
                                   context, batch)
    return getattr(cost, field)


@quoted
def k3_list_over_roofline(kind: str, precision: str = "int4", gpus: int | None = 64, batch: int | None = None) -> float:
    """The seeds' list price over the roofline cost of ``kind`` ("input" or "output") tokens."""
    field = f"usd_per_million_{kind}"
    return K3_LIST_USD_PER_MILLION[kind] / k3_serving(field, precision, gpus, batch)


@quoted
def k3_output_over_input(batch: int | None = None, precision: str = "int4", gpus: int | None = 64) -> float:
    """The roofline price of an output token over an input token's, K3 on B300s (the list prices say 5)."""
    return (k3_serving("usd_per_million_output", precision, gpus, batch)
            / k3_serving("usd_per_million_input", precision, gpus, batch))
