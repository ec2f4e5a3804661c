"""Plausible wrong answers for chapter 12 (train and validate)."""

import math

import numpy as np
import torch
import torch.nn.functional as F

from k3course.train.step import balance_experts


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

def _step(model, optimizer, scheduler, micro_batches, grad_clip, divide=True, clip_first=True,
          balance_each_micro_batch=False, weigh_by_targets=True, train_mode=True, zero_after=True):
    """The step with one thing changed by a flag; by default the right one (micro-batch j weighs n_j / N, n_j its
    counted targets, N all of them)."""
    if train_mode:
        model.train()
    if not zero_after:
        optimizer.zero_grad(set_to_none=True)
    counts = [int((targets != -100).sum()) for _, targets in micro_batches]
    weights = [count / sum(counts) if weigh_by_targets else 1 / len(counts) for count in counts]
    total, balance = 0.0, None
    for (inputs, targets), weight in zip(micro_batches, weights):
        _, loss, _ = model(inputs, targets=targets)
        (loss * weight if divide else loss).backward()
        total += loss.item() * weight
        if balance_each_micro_batch:
            balance = balance_experts(model)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)) if clip_first else None
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    if not clip_first:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    scheduler.step()
    if zero_after:
        optimizer.zero_grad(set_to_none=True)
    return {"loss": total, "lr": lr, "grad_norm": grad_norm, **(balance or balance_experts(model))}


def step_without_dividing(model, optimizer, scheduler, micro_batches, grad_clip):
    """backward(loss_j) per micro-batch: the gradient of the sum of A losses, A times the mean's."""
    return _step(model, optimizer, scheduler, micro_batches, grad_clip, divide=False)


def step_clips_after_the_step(model, optimizer, scheduler, micro_batches, grad_clip):
    """clip_grad_norm_ after optimizer.step(): AdamW already took the unclipped gradient."""
    return _step(model, optimizer, scheduler, micro_batches, grad_clip, clip_first=False)


def step_updates_the_bias_before_the_step(model, optimizer, scheduler, micro_batches, grad_clip):
    """The bias update inside the accumulation loop, before optimizer.step(): the later micro-batches route
    with a bias moved by part of the batch, and the rule sees each micro-batch alone."""
    return _step(model, optimizer, scheduler, micro_batches, grad_clip, balance_each_micro_batch=True)


def step_in_the_mode_it_was_handed(model, optimizer, scheduler, micro_batches, grad_clip):
    """Never calls model.train(): a model handed in eval mode trains without recording its routing, so the
    balancing bias never moves."""
    return _step(model, optimizer, scheduler, micro_batches, grad_clip, train_mode=False)


def step_zeroes_before_not_after(model, optimizer, scheduler, micro_batches, grad_clip):
    """zero_grad at the start of the step instead of the end: the step is right, but it leaves its gradients in
    .grad (memory held until the next step, and a leftover for whatever runs backward next)."""
    return _step(model, optimizer, scheduler, micro_batches, grad_clip, zero_after=False)


def step_weighs_micro_batches_equally(model, optimizer, scheduler, micro_batches, grad_clip):
    """backward(loss_j / A): the mean of the micro-batch means, not the mean over every counted target (they
    differ when micro-batches differ in size or in how many targets are ignored)."""
    return _step(model, optimizer, scheduler, micro_batches, grad_clip, weigh_by_targets=False)


def _windows_losses(model, windows, batch_size):
    model.eval()
    with torch.no_grad():
        for chunk in windows.split(batch_size):
            logits, _, _ = model(chunk[:, :-1])
            yield F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten()).item()
    model.train()


def bits_per_byte_in_nats(model, windows, batch_size):
    """The mean cross-entropy as it comes from F.cross_entropy: nats per byte, not bits."""
    losses = [loss * len(chunk) for loss, chunk in zip(_windows_losses(model, windows, batch_size),
                                                        windows.split(batch_size))]
    return sum(losses) / len(windows)


def bits_per_byte_per_batch(model, windows, batch_size):
    """The mean of the batches' means: a short last batch weighs as much as a full one."""
    losses = list(_windows_losses(model, windows, batch_size))
    return sum(losses) / len(losses) / math.log(2)


def bits_per_byte_from_the_models_loss(model, windows, batch_size):
    """The loss the model returns with targets, in the mode it was handed: a model in training adds its
    auxiliary balancing loss to the validation number (and records its routing)."""
    with torch.no_grad():
        losses = [model(chunk[:, :-1], targets=chunk[:, 1:])[1].item() * len(chunk)
                  for chunk in windows.split(batch_size)]
    return sum(losses) / len(windows) / math.log(2)


def bits_per_byte_ends_in_training_mode(model, windows, batch_size):
    """model.train() at the end whatever the mode it came in: an evaluation inside generation or a lesson's
    eval-mode model comes back training."""
    losses = [loss * len(chunk) for loss, chunk in zip(_windows_losses(model, windows, batch_size),
                                                        windows.split(batch_size))]
    return sum(losses) / len(windows) / math.log(2)


def bits_per_byte_leaves_eval_mode(model, windows, batch_size):
    """model.eval() and never back: the training loop that called it goes on in eval mode."""
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(chunk[:, :-1])[0].flatten(0, 1).float(), chunk[:, 1:].flatten(),
                                  reduction="sum").item() for chunk in windows.split(batch_size)]
    return sum(losses) / (windows.shape[0] * (windows.shape[1] - 1)) / math.log(2)


WRONG = {
    "12.lr_factor": [schedule_warmup_from_zero, schedule_cosine_to_zero, schedule_linear_decay,
                  schedule_cosine_past_the_end, schedule_divides_by_the_decay_length],
    "12.ngram_bits_per_byte": [ngram_in_nats, ngram_unnormalised, ngram_ignores_history],
    "12.train_step": [step_without_dividing, step_clips_after_the_step, step_updates_the_bias_before_the_step,
                      step_in_the_mode_it_was_handed, step_zeroes_before_not_after, step_weighs_micro_batches_equally],
    "12.evaluate": [bits_per_byte_in_nats, bits_per_byte_per_batch, bits_per_byte_from_the_models_loss,
                    bits_per_byte_ends_in_training_mode, bits_per_byte_leaves_eval_mode],
}
