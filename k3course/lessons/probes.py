"""Short instrumented training runs for lesson 12: the first steps of a claim's run, with what the step returns
and what the router's scores look like, and the resolution of a saturated sigmoid router.

:func:`probe_run` trains like :func:`k3course.lessons.claims.run_variant` (the same model, schedule and batches for
a given seed) but stops after ``steps`` and keeps every step's record: loss, rate, gradient norm before clipping,
max-violation, and, for a quantile-balanced model, how the router's scores of the last MoE layer spread over the
step's tokens and how far they moved since the step before (the two numbers that decide whether a bias computed
from one step's scores still balances the next step's tokens).
"""

from __future__ import annotations

import torch

from k3course import data, train
from k3course.config import K3Config
from k3course.guards import is_number
from k3course.moe.routing import topk_route


def probe_run(cfg: K3Config, settings: train.TrainConfig, corpus: data.ByteCorpus, steps: int, seed: int = 0,
              gamma: float | None = None) -> list[dict]:
    """The first ``steps`` optimizer steps of ``cfg`` under ``settings`` (seed replaced by ``seed``; the schedule
    is the full ``settings.steps`` run's). ``gamma``: the sign rule's step on every MoE layer (None: the layer's).

    Returns one dict per step: train_step's record and, when the last MoE layer records its scores (quantile
    balancing), "score_spread" = mean over experts of the std over tokens of s [M, n], "score_max" = max s, and
    "score_shift" = mean over experts of |mean over tokens of s − the same at the step before| (from the second
    step on).
    """
    if not is_number(steps) or not 1 <= steps <= settings.steps:
        raise ValueError(f"steps must be an int in [1, settings.steps = {settings.steps}], got {steps!r}")
    settings = settings.replace(seed=seed, grad_accum=1)  # one micro-batch per step
    stepper = train.Stepper(cfg, settings, train.text_batches(corpus.train, settings))
    moes = stepper.model.moe_layers()
    for moe in moes if gamma is not None else ():
        moe.balancer.gamma = gamma
    seen: list[torch.Tensor] = []

    def keep_scores(module, args, output) -> None:  # this forward's rows of the layer's score record
        tokens = args[0].reshape(-1, module.d_model).shape[0]
        record = module.balancer
        seen.append(record.recorded_scores[record.recorded_tokens - tokens:record.recorded_tokens].clone())

    if moes and moes[-1].balancer.balancing == "quantile":
        moes[-1].register_forward_hook(keep_scores)
    records, previous = [], None
    for _ in range(steps):
        seen.clear()
        record = stepper()
        if seen:
            scores = torch.cat(seen)
            record["score_spread"] = scores.std(0).mean().item()
            record["score_max"] = scores.max().item()
            if previous is not None:
                record["score_shift"] = (scores.mean(0) - previous).abs().mean().item()
            previous = scores.mean(0)
        records.append(record)
    return records


def saturated_split(logits: torch.Tensor, bias_gaps: torch.Tensor) -> torch.Tensor:
    """How a bias splits tokens between two experts: logits [M, 2] of M tokens for experts 0 and 1, scored by a
    float32 sigmoid and routed top-1 with bias (0, gap) for each gap in ``bias_gaps`` [G] -> the fraction of the
    tokens sent to expert 1, [G]. On a saturated router many tokens score exactly 1.0 for both experts: a bias
    then moves all of them at once, and no gap splits them."""
    if logits.dim() != 2 or logits.shape[1] != 2:
        raise ValueError(f"logits must be [M, 2] (tokens × two experts), got {tuple(logits.shape)}")
    scores = torch.sigmoid(logits.float())
    fractions = []
    for gap in bias_gaps.tolist():
        expert_idx, _ = topk_route(scores, 1, torch.tensor([0.0, gap]))
        fractions.append((expert_idx == 1).float().mean())
    return torch.stack(fractions)
