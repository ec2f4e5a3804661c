"""A tiny language model for the recall experiment: which token mixer can learn MQAR (``k3course.data.mqar``)?

Each block is pre-norm: x + mixer(norm(x)), then x + MLP(norm(x)). Only the mixer differs between runs.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from k3course.data import IGNORE, mqar
from k3course.layers.kda import DecayedLinearAttention, GatedDeltaNet, KimiDeltaAttention, initial_dt_bias
from k3course.lessons.fit import cross_entropy_at, fit

MIXERS = {"decayed linear": DecayedLinearAttention, "GDN": GatedDeltaNet, "KDA": KimiDeltaAttention}

# How the controlled runs lay KDA's starting decays (−g at z = 0, each spread geometrically from 0.01 to 0.5 by
# :func:`~k3course.layers.kda.initial_dt_bias`) over its H·K channels:
#   across_heads  over all H·K channels in order: K3's layer as built, head 0 the slowest, the last the fastest
#   per_head      one value per head on all its channels: GDN's head h starts at the same −g (H values)
#   within_heads  over each head's own K channels: every head spans 0.01 to 0.5
DECAY_INITS = ("across_heads", "per_head", "within_heads")


def decay_layout(n_heads: int, head_dim: int, lower_bound: float | None, decay_init: str) -> torch.Tensor:
    """KDA's dt_bias ``[H, K]`` laid out by ``decay_init`` (one of :data:`DECAY_INITS`)."""
    if decay_init == "across_heads":
        return initial_dt_bias(n_heads * head_dim, lower_bound).view(n_heads, head_dim)
    if decay_init == "per_head":
        return initial_dt_bias(n_heads, lower_bound)[:, None].repeat(1, head_dim)
    if decay_init == "within_heads":
        return initial_dt_bias(head_dim, lower_bound).repeat(n_heads, 1)
    raise ValueError(f"decay_init must be one of {DECAY_INITS}, got {decay_init!r}")


def decay_ranges(decays) -> list[list[float]]:
    """[min, max] over each head's channels of decay rates ``[H, K]``, head by head."""
    return [[row.min().item(), row.max().item()] for row in decays]


class RecallModel(nn.Module):
    """Embedding -> ``n_layers`` × (mixer, MLP) -> norm -> logits ``[B, T, vocab]``.

    ``kda_options`` (KDA only): ``decay_init`` (how the starting decays are laid out, :func:`decay_layout`; left
    out, the layer's own: "across_heads") and :class:`~k3course.layers.kda.KimiDeltaAttention`'s ``lower_bound``
    (K3's bounded gate, or None: Kimi Linear's softplus gate); left out, the layer's defaults (K3's)."""

    def __init__(self, vocab_size: int, mixer: str, d_model: int = 64, n_layers: int = 2, n_heads: int = 2,
                 chunk_size: int = 32, **kda_options):
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {sorted(MIXERS)}, got {mixer!r}")
        if kda_options and mixer != "KDA":
            raise ValueError(f"kda_options ({', '.join(kda_options)}) apply to KDA only, got them for {mixer!r}")
        if not set(kda_options) <= {"decay_init", "lower_bound"}:
            raise ValueError(f"kda_options must be decay_init or lower_bound, got {sorted(kda_options)}")
        decay_init = kda_options.pop("decay_init", None)
        self.embed = nn.Embedding(vocab_size, d_model)
        head_dim = d_model // n_heads
        self.mixers = nn.ModuleList(MIXERS[mixer](d_model, n_heads, head_dim, chunk_size=chunk_size, **kda_options)
                                    for _ in range(n_layers))
        if decay_init is not None:
            layout = decay_layout(n_heads, head_dim, self.mixers[0].lower_bound, decay_init)
            with torch.no_grad():
                for layer in self.mixers:
                    layer.dt_bias.copy_(layout)
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(),
                                                nn.Linear(2 * d_model, d_model)) for _ in range(n_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(2 * n_layers + 1))
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def starting_decays(self) -> list[list[float]]:
        """[min, max] of −g at z = 0 over each head's channels, head by head, in the first mixer layer (its
        :meth:`~k3course.layers.kda.KimiDeltaAttention.starting_decays`): the decay rates recall starts from."""
        return decay_ranges(self.mixers[0].starting_decays())

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, (mixer, mlp) in enumerate(zip(self.mixers, self.mlps)):
            x = x + mixer(self.norms[2 * i](x))[0]
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.head(self.norms[-1](x))


@torch.no_grad()
def recall_accuracy(model: nn.Module, tokens, targets) -> float:
    """Fraction of query positions (targets ≠ IGNORE) where the arg-max prediction is the stored value."""
    asked = targets != IGNORE
    predictions = model(tokens).argmax(-1)
    return (predictions[asked] == targets[asked]).float().mean().item()


@torch.no_grad()
def recall_by_pair(model: nn.Module, tokens, targets, n_pairs: int) -> list[float]:
    """Recall accuracy by write order: entry i is the fraction of queries for the i-th pair written (i = 0 the
    oldest, n_pairs − 1 the last) that the arg-max prediction answers. ``tokens``, ``targets`` as from
    :func:`k3course.data.mqar` (the pairs k_1 v_1 … k_n v_n first)."""
    asked = targets != IGNORE
    correct = (model(tokens).argmax(-1) == targets) & asked
    written = tokens[:, 0:2 * n_pairs:2]  # [N, n_pairs]: the keys in write order
    order = (tokens[:, :, None] == written[:, None, :]).float().argmax(-1)  # [N, T]: write index of each token's key
    hits = torch.zeros(n_pairs).index_add_(0, order[asked], correct[asked].float())
    counts = torch.zeros(n_pairs).index_add_(0, order[asked], torch.ones(int(asked.sum())))
    return (hits / counts.clamp(min=1)).tolist()


def train_recall(mixer: str, steps: int = 300, batch_size: int = 32, seq_len: int = 64, n_pairs: int = 8,
                 vocab_size: int = 64, lr: float = 3e-3, seed: int = 0, eval_every: int = 0, **model_kwargs) -> dict:
    """Train a :class:`RecallModel` on fresh MQAR batches.

    Returns ``{"mixer", "losses", "accuracy", "history", "seconds"}``: the training losses, the final recall
    accuracy on a held-out batch of 256 sequences, ``history`` = [(step, held-out accuracy)] every
    ``eval_every`` steps (if > 0) and at the end, and the wall time.

    Seeded: the model's initialisation (under a forked RNG, so no global state changes), the training batches
    (seeds ``seed·10⁶ + step``) and the held-out batch (seed ``10⁹ + seed``, never a training seed).
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = RecallModel(vocab_size, mixer, **model_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    held_out = mqar(256, seq_len, n_pairs, vocab_size, seed=10**9 + seed)
    history, start = [], time.perf_counter()
    batch_at = lambda step: mqar(batch_size, seq_len, n_pairs, vocab_size, seed=seed * 10**6 + step)
    losses = fit(optimizer, steps, cross_entropy_at(model, batch_at), schedule_kind="one_cycle", every=eval_every,
                 at_every=lambda step: history.append((step, recall_accuracy(model, *held_out))))
    accuracy = recall_accuracy(model, *held_out)
    history.append((steps, accuracy))
    return {"mixer": mixer, "losses": losses, "accuracy": accuracy, "history": history,
            "seconds": time.perf_counter() - start}
