"""Plausible wrong answers for chapter 12 (train and validate)."""

import math

import numpy as np


def schedule_warmup_from_zero(step, warmup_steps, total_steps, min_lr_ratio):
    """Warmup step / W: the first step trains at rate 0."""
    if step < warmup_steps:
        return step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_cosine_to_zero(step, warmup_steps, total_steps, min_lr_ratio):
    """Ignores the floor: the cosine ends at 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1 + math.cos(math.pi * progress))


def schedule_linear_decay(step, warmup_steps, total_steps, min_lr_ratio):
    """Linear instead of cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 1 - (1 - min_lr_ratio) * progress


def _codes(x, order):
    x = np.asarray(x, dtype=np.int64)
    return sum(x[i:len(x) - order + 1 + i] << (8 * (order - 1 - i)) for i in range(order))


def _ngram(train, val, order, k, denominator_k=256, log=np.log2):
    counts = np.bincount(_codes(train, order), minlength=256 ** order).astype(np.float64)
    history = counts.reshape(-1, 256).sum(1)
    codes = _codes(val, order)
    return float(-log((counts[codes] + k) / (history[codes >> 8] + denominator_k * k)).mean())


def ngram_in_nats(train, val, order, k=0.1):
    """Natural log: nats per byte, not bits."""
    return _ngram(train, val, order, k, log=np.log)


def ngram_unnormalised(train, val, order, k=0.1):
    """Adds k to the count but only k (not 256 k) to the history: probabilities do not sum to 1."""
    return _ngram(train, val, order, k, denominator_k=1)


def ngram_ignores_history(train, val, order, k=0.1):
    """Always the unigram model, whatever the order."""
    return _ngram(train, val, 1, k)


def schedule_cosine_past_the_end(step, warmup_steps, total_steps, min_lr_ratio):
    """Does not clamp the progress at 1: past the last step the cosine climbs back up."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_divides_by_the_decay_length(step, warmup_steps, total_steps, min_lr_ratio):
    """Divides by total − warmup: ZeroDivisionError once the warmup is the whole run and the warmup is over."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

WRONG = {
    "12.lr_factor": [schedule_warmup_from_zero, schedule_cosine_to_zero, schedule_linear_decay,
                  schedule_cosine_past_the_end, schedule_divides_by_the_decay_length],
    "12.ngram_bits_per_byte": [ngram_in_nats, ngram_unnormalised, ngram_ignores_history],
}
