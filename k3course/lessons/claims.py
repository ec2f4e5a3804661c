"""The model variants behind chapter 12's claims, and the one runner that trains any of them.

Each claim compares K3 configurations that differ in one named way (the rest of :class:`K3Config` held fixed):

claim                         variants of                  what differs
tiny K3 vs dense Transformer  the ``tiny`` preset          all-MLA (ungated, RoPE), SwiGLU, PreNorm, a dense FFN in
                                                           every layer, its width solved so the active parameters
                                                           match
hybrid ratio                  :data:`DEEP` (8 layers)      KDA:MLA 0:1 (RoPE), 1:1, 3:1, 7:1, all-KDA; 0:1 NoPE
residuals                     :data:`DEEP`                 PreNorm, Block AttnRes (4 blocks), Full AttnRes
balancing                     :data:`SMALL`                quantile (K3), sign rule (DeepSeek-V3), aux loss (Switch)
latent MoE                    :data:`SMALL`                full-width experts vs latent ℓ = d/2 with n·d/ℓ experts,
                                                           k·d/ℓ active (published) or the same n, k (wider
                                                           experts); expert widths solved for equal active FLOPs
more experts                  :data:`SMALL`                8, 32, 112 routed experts at top-2 (activation 25% → 1.8%)

:func:`run_variant` trains one of them with the package's own training step (:func:`k3course.train.step.train_step`:
AdamW, warmup + cosine, clipping, the MoE bias update) on the stdlib bytes or on MQAR, and returns its per-step
losses and max-violations and its final validation number. A run is a function of (config, training settings,
seed): model initialisation and batches are seeded, so its first steps can be replayed (``stop_after``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from k3course import data, train
from k3course.baselines import dense_transformer, solve_width
from k3course.config import K3Config
from k3course.data import IGNORE
from k3course.moe.latent import all_to_all_bytes_per_token, moe_flops_per_token
from k3course.train.generate import generate_text
from k3course.train.step import LN2, evaluate

# A K3 with every feature of the tiny preset at half its width: the base of the balancing and MoE claims.
SMALL = K3Config.preset("tiny").replace(
    name="claims-small", d_model=64, kda_n_heads=2, kda_head_dim=32, mla_n_heads=2, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32, expert_dim=64, latent_dim=32, dense_ffn_dim=128,
    context_length=128)
# Deeper and narrower than tiny (8 layers of width 64, 16 sub-layers): room for a 7:1 schedule and for depth to
# matter to the residual scheme. Block AttnRes in 4 blocks of 4 sub-layers.
DEEP = SMALL.replace(name="claims-deep", n_layers=8, attnres_block_size=4)

# Every text run: 120 steps of 8 × 64 bytes (61 kB, 0.5% of the training split), validation on 16 kB.
TEXT_TRAIN = train.TrainConfig(steps=120, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=12, eval_every=0,
                               eval_bytes=16384, checkpoint_every=0)
# The default run's budget (k3course train --preset tiny: 800 steps of 16 × 128 bytes, 1.6 MB, validation on 128 kB),
# where the tiny K3 beats the byte trigram: the budget of the claims that need models past their first steps.
DEFAULT_TEXT_TRAIN = train.TrainConfig(eval_every=0, checkpoint_every=0)
# Harder MQAR than lesson 06 (6 pairs in 16-channel heads): 20 pairs, more than a 16-channel head has dimensions.
MQAR_TASK = dict(seq_len=64, n_pairs=20, vocab_size=64)
# The hybrid schedules on that MQAR: 1500 steps of 16 sequences (at 300 every schedule is still at chance).
MQAR_TRAIN = train.TrainConfig(steps=1500, batch_size=16, seq_len=MQAR_TASK["seq_len"], lr=3e-3, warmup_steps=30,
                               eval_every=0, checkpoint_every=0)
MQAR_HELD_OUT = 256  # held-out sequences for recall accuracy (seed 10⁹ + seed, never a training seed)


# --- the variants ---------------------------------------------------------------------------------------

def hybrid_variants(cfg: K3Config = DEEP) -> dict[str, K3Config]:
    """KDA:MLA schedules of ``cfg``'s depth: all-MLA (0:1), 1:1, 3:1, 7:1 and all-KDA (the last layer stays MLA
    in every ratio r:1, :func:`k3course.config.layer_schedule`). All-MLA has RoPE (``mla_rope``): K3's MLA is NoPE
    because its KDA layers carry position, and without them a model has none; the NoPE all-MLA is kept as a named
    ablation, "0:1 (all-MLA, NoPE)", which measures positions, not the hybrid."""
    ratios = {f"{r}:1" + (" (all-MLA)" if r == 0 else ""): cfg.replace(kda_per_mla=r, mla_rope=r == 0 or cfg.mla_rope)
              for r in (0, 1, 3, 7)}
    return {**ratios, "all-KDA": cfg.replace(mla_layers=()), "0:1 (all-MLA, NoPE)": cfg.replace(kda_per_mla=0)}


def residual_variants(cfg: K3Config = DEEP) -> dict[str, K3Config]:
    """PreNorm, Block AttnRes (``cfg.attnres_block_size`` sub-layers per block) and Full AttnRes (blocks of one
    sub-layer: every layer attends over every earlier output)."""
    return {"PreNorm": cfg.replace(residual="prenorm"), "Block AttnRes": cfg.replace(residual="block_attnres"),
            "Full AttnRes": cfg.replace(residual="block_attnres", attnres_block_size=1)}


def balancing_variants(cfg: K3Config = SMALL) -> dict[str, K3Config]:
    """Quantile balancing (K3), the sign rule (DeepSeek-V3, γ = 10⁻³) and the Switch aux loss (α = 10⁻²)."""
    return {"quantile": cfg.replace(balancing="quantile"), "sign rule": cfg.replace(balancing="sign"),
            "aux loss": cfg.replace(balancing="aux_loss")}


def moe_flops(cfg: K3Config) -> int:
    """Active forward FLOPs per token of one of ``cfg``'s MoE layers
    (:func:`k3course.moe.latent.moe_flops_per_token`)."""
    return moe_flops_per_token(cfg.d_model, cfg.n_routed_experts, cfg.top_k, cfg.expert_dim, cfg.latent_dim,
                               cfg.n_shared_experts)


def all_to_all_bytes(cfg: K3Config) -> int:
    """Bytes per token per MoE layer across expert-parallel ranks, bf16 (dispatch + combine: 2·k·width·2)."""
    return all_to_all_bytes_per_token(cfg.d_model, cfg.top_k, cfg.latent_dim)


def latent_variants(cfg: K3Config = SMALL) -> dict[str, K3Config]:
    """Full-width experts vs latent experts at equal active MoE FLOPs (the down- and up-projections count; each
    latent variant's expert width solved to match full width's FLOPs).

    full width               cfg's n experts, top-k, expert width, on the full width d (the reference FLOPs)
    latent (N experts, top-K)  the published design (LatentMoE): on ℓ = d/2 the d/ℓ saving buys n·d/ℓ experts and
                             k·d/ℓ active, so the all-to-all bytes per token equal full width's
    latent, wider experts    the same n and k on ℓ: the saving spent on expert width (a design nobody claims;
                             half the all-to-all bytes)
    """
    full = cfg.replace(latent_dim=None)
    latent = cfg.d_model // 2
    scale = cfg.d_model // latent
    published = lambda width: cfg.replace(latent_dim=latent, n_routed_experts=cfg.n_routed_experts * scale,
                                          top_k=cfg.top_k * scale, expert_dim=width)
    wider = lambda width: cfg.replace(latent_dim=latent, expert_dim=width)
    target = moe_flops(full)
    return {"full width": full,
            f"latent ({cfg.n_routed_experts * scale} experts, top-{cfg.top_k * scale})":
                solve_width(published, moe_flops, target),
            "latent, wider experts": solve_width(wider, moe_flops, target)}


EXPERT_COUNTS = (8, 32, 112)  # top-2: 25%, 6.25%, 1.79% (K3: 16 of 896)


def expert_count_variants(cfg: K3Config = SMALL, counts: tuple[int, ...] = EXPERT_COUNTS) -> dict[str, K3Config]:
    """``cfg`` with n routed experts for each n in ``counts`` at its top-k and expert width: the active
    parameters stay fixed except the router (n·d per MoE layer); the activation ratio k/n falls."""
    return {f"{n} experts ({cfg.top_k / n:.1%})": cfg.replace(n_routed_experts=n) for n in counts}


def dense_variants() -> dict[str, K3Config]:
    """The tiny K3 preset and :func:`dense_transformer` of it."""
    tiny = K3Config.preset("tiny")
    return {"tiny K3": tiny, "dense Transformer": dense_transformer(tiny)}


def depth_variants(cfg: K3Config = DEEP) -> dict[str, K3Config]:
    """The hybrid schedules' all-KDA (:func:`hybrid_variants`, no MLA layer) at 2 layers and at ``cfg``'s depth:
    where §6.2's all-KDA K3 and §6.3's 2-layer recall model part, the block and its settings kept."""
    all_kda = cfg.replace(mla_layers=())
    return {"K3 all-KDA, 2 layers": all_kda.replace(n_layers=2), f"K3 all-KDA, {cfg.n_layers} layers": all_kda}


# claim -> its variants {label: config}
CLAIMS: dict[str, Callable[[], dict[str, K3Config]]] = {
    "dense-baseline": dense_variants, "hybrid-ratio": hybrid_variants, "residuals": residual_variants,
    "balancing": balancing_variants, "latent-moe": latent_variants, "expert-count": expert_count_variants,
    "depth": depth_variants}


# --- one run ----------------------------------------------------------------------------------------------

def text_training_steps(cfg: K3Config, settings: train.TrainConfig, device: torch.device | str = "cpu"
                        ) -> train.Stepper:
    """A fresh seeded model of ``cfg`` and its optimizer on ``device``; each call trains one step on the next text
    batch (for timing a variant's step as :func:`run_variant` takes it)."""
    return train.Stepper(cfg, settings, train.text_batches(data.stdlib_corpus().train, settings, device), device)


def _mqar_batches(settings: train.TrainConfig, device: torch.device | str) -> Callable[[int], list]:
    """Step i → [mqar(batch_size, seed=seed·10⁶ + i, **MQAR_TASK)] on ``device``."""
    def batches(step: int) -> list:
        tokens, targets = data.mqar(settings.batch_size, seed=settings.seed * 10**6 + step, **MQAR_TASK)
        return [(tokens.to(device), targets.to(device))]
    return batches


@torch.no_grad()
def recall_accuracy(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of query positions (targets ≠ IGNORE) where the model's arg-max is the stored value."""
    model.eval()
    device = next(model.parameters()).device
    tokens, targets = tokens.to(device), targets.to(device)
    asked = targets != IGNORE
    predictions = model(tokens)[0].argmax(-1)
    return (predictions[asked] == targets[asked]).float().mean().item()


def run_variant(cfg: K3Config, settings: train.TrainConfig, seed: int, task: str = "text",
                stop_after: int | None = None, corpus: data.ByteCorpus | None = None,
                sample_prompt: str | None = None, device: torch.device | str = "cpu") -> dict:
    """Train ``cfg`` with ``settings`` (its seed replaced by ``seed``) on ``task`` ("text" or "mqar").

    text  batches :func:`k3course.data.batch_at` of the stdlib corpus; result "val_bpb": validation bits/byte
          on ``settings.eval_bytes`` bytes (cross-entropy only, no auxiliary loss).
    mqar  batch ``step`` is ``mqar(batch_size, seed=seed·10⁶ + step, **MQAR_TASK)``; result "accuracy": recall
          on :data:`MQAR_HELD_OUT` held-out sequences (seed 10⁹ + seed).

    Returns {"losses", "max_violation" (per step, worst MoE layer), "val_bpb" or "accuracy", "seconds"}, and
    "sample" when ``sample_prompt`` is given: 200 bytes after it (temperature 0.8, top-k 20, seed 0).
    ``stop_after`` ends the run early without changing any earlier step (the schedule is the full run's) and
    returns only the losses and max-violations (to replay a saved run's first steps). ``device``: where the model
    and its batches live.
    """
    if task not in ("text", "mqar"):
        raise ValueError(f"task must be 'text' or 'mqar', got {task!r}")
    if stop_after is not None and not 1 <= stop_after <= settings.steps:
        raise ValueError(f"stop_after must be None or in [1, steps = {settings.steps}], got {stop_after!r}")
    settings = settings.replace(seed=seed)
    corpus = corpus or (data.stdlib_corpus() if task == "text" else None)
    batches = train.text_batches(corpus.train, settings, device) if task == "text" \
        else _mqar_batches(settings, device)
    began = time.perf_counter()
    stepper = train.Stepper(cfg, settings, batches, device)
    model = stepper.model
    losses, violations = [], []
    for _ in range(settings.steps if stop_after is None else stop_after):
        record = stepper()
        losses.append(record["loss"])
        violations.append(record["max_violation"])
    result = {"losses": losses, "max_violation": violations}
    if stop_after is not None:
        return result
    if task == "text":
        windows = data.eval_windows(corpus.val, settings.seq_len, settings.eval_bytes)
        result["val_bpb"] = evaluate(model, windows, settings.batch_size) / LN2
    else:
        held_out = data.mqar(MQAR_HELD_OUT, seed=10**9 + seed, **MQAR_TASK)
        result["accuracy"] = recall_accuracy(model, *held_out)
    result["seconds"] = time.perf_counter() - began
    if sample_prompt is not None:
        result["sample"] = generate_text(model, sample_prompt, 200, temperature=0.8, top_k=20, seed=0)
    return result
