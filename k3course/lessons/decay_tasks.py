"""Small experiments that tell the token mixers apart, one per lesson (04, 05, 06).

- :func:`two_timescales` + :class:`DecayMemory` (lesson 04): one head of decayed linear attention must hold a
  value from the first token for the whole sequence *and* track a fast running average of a noisy stream.
  That needs two forgetting rates in one head: a channel gate (GLA) can, a scalar gate (one rate per head)
  cannot.
- :func:`pair_recall_error` (lesson 05): write n random key-value pairs with linear attention or the delta rule,
  read every value back; no training.
- :func:`segment_recall` + :class:`DeltaNet` (lesson 05): key-value recall in several independent segments
  of one sequence; a key asked about but not stored in the current segment must be answered "none". The
  state has to drop the previous segment's pairs at each separator, all of them at once: a forget gate can,
  the plain delta rule (which erases one key direction per token) cannot.
- :func:`recall_seeds` (lesson 06): the recall comparison of :mod:`k3course.lessons.recall` repeated over
  seeds, for a setting with more pairs than key channels.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from k3course.data import IGNORE
from k3course.debug import progress_bar
from k3course.guards import is_number
from k3course.layers.kda import GatedDeltaNet, initial_dt_bias
from k3course.lessons.fit import cross_entropy_at, fit
from k3course.lessons.recall import RecallModel, train_recall
from k3course.ops.parallel import decay_attention_parallel


def _require_int(name: str, value, minimum: int) -> None:
    if not is_number(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an int ≥ {minimum}, got {value!r}")


# --- lesson 04: two timescales in one head ------------------------------------------------------------------

TWO_TIMESCALE_INPUTS = ("value to keep", "stream", "start marker", "constant")
TWO_TIMESCALE_TARGETS = ("kept value", "running average")


def two_timescales(n_samples: int, seq_len: int, seed: int, fast_decay: float = 0.7):
    """Seeded batch of the two-timescales task: ``(inputs [N, T, 4], targets [N, T, 2])``, float32.

    Inputs per token (:data:`TWO_TIMESCALE_INPUTS`): a value c ~ N(0, 1) at t = 0 only; a stream a_t ~ N(0, 1)
    for t ≥ 1 (0 at t = 0); a start marker (1 at t = 0); a constant 1. Targets at every t
    (:data:`TWO_TIMESCALE_TARGETS`): c itself, held from the first token, and the stream's running average
    m_t = √(1 − λ²) Σ_{1≤s≤t} λ^{t−s} a_s with λ = ``fast_decay`` (unit variance once t ≫ 1/(1 − λ)).
    """
    _require_int("n_samples", n_samples, 1)
    _require_int("seq_len", seq_len, 2)
    if not 0 < fast_decay < 1:
        raise ValueError(f"fast_decay must be in (0, 1), got {fast_decay!r}")
    generator = torch.Generator().manual_seed(seed)
    kept = torch.randn(n_samples, generator=generator)
    stream = torch.randn(n_samples, seq_len, generator=generator)
    stream[:, 0] = 0.0
    inputs = torch.zeros(n_samples, seq_len, 4)
    inputs[:, 0, 0], inputs[:, :, 1], inputs[:, 0, 2], inputs[:, :, 3] = kept, stream, 1.0, 1.0
    average, running = torch.zeros(n_samples, seq_len), torch.zeros(n_samples)
    for t in range(seq_len):
        running = fast_decay * running + stream[:, t]
        average[:, t] = running
    targets = torch.stack([kept[:, None].expand(-1, seq_len), average * math.sqrt(1 - fast_decay**2)], dim=-1)
    return inputs, targets


class DecayMemory(nn.Module):
    """One layer of decayed linear attention with a linear read-out, for :func:`two_timescales`.

    q, k = W_q x, W_k x ``[B, T, H, K]``; v = W_v x ``[B, T, H, V]``; log-decay g = −softplus(W_g x + b), data
    dependent as in GLA: ``gate="channel"`` gives g ``[B, T, H, K]`` (one rate per key channel), ``"scalar"``
    g ``[B, T, H]`` (one rate per head). y = W_o [o_1 … o_H] with o the parallel form (scale 1). The rates
    start spread from −g = 0.01 to 0.5 over the gates (:func:`initial_dt_bias`).
    """

    def __init__(self, gate: str, n_heads: int = 1, key_dim: int = 4, value_dim: int = 2, n_inputs: int = 4,
                 n_outputs: int = 2):
        super().__init__()
        if gate not in ("scalar", "channel"):
            raise ValueError(f"gate must be 'scalar' or 'channel', got {gate!r}")
        for name, value in (("n_heads", n_heads), ("key_dim", key_dim), ("value_dim", value_dim),
                            ("n_inputs", n_inputs), ("n_outputs", n_outputs)):
            _require_int(name, value, 1)
        self.gate, self.n_heads, self.key_dim, self.value_dim = gate, n_heads, key_dim, value_dim
        self.q_proj, self.k_proj = (nn.Linear(n_inputs, n_heads * key_dim, bias=False) for _ in range(2))
        self.v_proj = nn.Linear(n_inputs, n_heads * value_dim, bias=False)
        n_gates = n_heads * (key_dim if gate == "channel" else 1)
        self.g_proj = nn.Linear(n_inputs, n_gates)
        with torch.no_grad():
            self.g_proj.bias.copy_(initial_dt_bias(n_gates, None))
        self.o_proj = nn.Linear(n_heads * value_dim, n_outputs, bias=False)

    def log_decay(self, x):
        """g = −softplus(W_g x + b): ``[B, T, H, K]`` (channel) or ``[B, T, H]`` (scalar)."""
        g = -F.softplus(self.g_proj(x))
        return g.unflatten(-1, (self.n_heads, self.key_dim)) if self.gate == "channel" else g

    def forward(self, x):
        """x ``[B, T, n_inputs]`` -> y ``[B, T, n_outputs]``."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.q_proj.in_features:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be [B, T, n_inputs={self.q_proj.in_features}], got {shape}")
        q, k, v = (self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        o = decay_attention_parallel(q, k, v, self.log_decay(x), scale=1.0)  # [B, T, H, V]
        return self.o_proj(o.flatten(-2))

    def _heads(self, y):
        return y.unflatten(-1, (self.n_heads, -1))  # [B, T, H·D] -> [B, T, H, D]


def train_two_timescales(gate: str, steps: int = 200, batch_size: int = 32, seq_len: int = 40, lr: float = 3e-2,
                         seed: int = 0, fast_decay: float = 0.7, **model_kwargs) -> dict:
    """Train a :class:`DecayMemory` on fresh :func:`two_timescales` batches with the mean squared error.

    Returns ``{"gate", "losses", "errors", "retention", "seconds"}``: training losses; ``errors`` = held-out
    mean squared error per target (1.0 is what predicting 0 scores), averaged over 256 sequences and every
    t ≥ seq_len/4 (past the running average's warm-up); ``retention`` = the learned e^g per gate at the
    held-out batch's last token, averaged over sequences, ``[H, K]`` or ``[H]``; wall time. Seeded like
    :func:`k3course.lessons.recall.train_recall` (training batch seeds seed·10⁶ + step, held-out 10⁹ + seed).
    """
    _require_int("steps", steps, 1)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DecayMemory(gate, **model_kwargs)
    def loss_at(step: int) -> torch.Tensor:
        inputs, targets = two_timescales(batch_size, seq_len, seed * 10**6 + step, fast_decay)
        return F.mse_loss(model(inputs), targets)

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    start = time.perf_counter()
    losses = fit(optimizer, steps, loss_at, schedule_kind="one_cycle")
    inputs, targets = two_timescales(256, seq_len, 10**9 + seed, fast_decay)
    with torch.no_grad():
        errors = (model(inputs) - targets)[:, seq_len // 4:].square().mean((0, 1))
        retention = model.log_decay(inputs)[:, -1].exp().mean(0)
    return {"gate": gate, "losses": losses, "errors": dict(zip(TWO_TIMESCALE_TARGETS, errors.tolist())),
            "retention": retention, "seconds": time.perf_counter() - start}


# --- lesson 05: recall across segments, where the state must be cleared --------------------------------------

SEPARATOR, NONE = 1, 2  # token ids; keys are [3, vocab/2), values [vocab/2, vocab)


def segment_recall(n_samples: int, n_segments: int, n_pairs: int, n_queries: int, vocab_size: int, seed: int):
    """Seeded batch of recall in independent segments: ``(tokens, targets, stale)``, each ``[N, T]``.

    T = n_segments·(1 + 2·n_pairs + n_queries). Each segment is ``SEP k_1 v_1 … k_n v_n q_1 … q_m``: a separator,
    n fresh pairs (distinct keys, random values; a key may reappear with a new value in a later segment), then m
    queries, answered at the query token itself. ⌈m/2⌉ queries ask for keys of this segment (target: the value);
    ⌊m/2⌋ ask for keys *not* in it (target: :data:`NONE`), taken from the previous segment's keys when there is
    one. ``stale`` (bool) marks those: queries whose key the state may still hold from before the separator.
    ``targets`` is ``IGNORE`` (−100) off the queries, as in :func:`k3course.data.mqar`.
    """
    for name, value, minimum in (("n_samples", n_samples, 1), ("n_segments", n_segments, 1),
                                 ("n_pairs", n_pairs, 1), ("n_queries", n_queries, 2)):
        _require_int(name, value, minimum)
    half, n_absent = vocab_size // 2, n_queries // 2
    if n_absent > n_pairs or half - 3 < n_pairs + n_absent:
        raise ValueError(f"vocab_size/2 − 3 = {half - 3} keys must cover n_pairs + n_queries//2 = "
                         f"{n_pairs + n_absent}, and n_queries//2 ≤ n_pairs; got vocab_size={vocab_size}, "
                         f"n_pairs={n_pairs}, n_queries={n_queries}")
    rng = np.random.default_rng(seed)
    segment = 1 + 2 * n_pairs + n_queries
    tokens = np.zeros((n_samples, n_segments * segment), dtype=np.int64)
    targets = np.full(tokens.shape, IGNORE, dtype=np.int64)
    stale = np.zeros(tokens.shape, dtype=bool)
    all_keys = np.arange(3, half)
    for row in range(n_samples):
        previous = None
        for index in range(n_segments):
            start = index * segment
            pool = all_keys if previous is None else previous
            absent = rng.choice(pool, size=n_absent, replace=False)  # asked about, not stored in this segment
            keys = rng.choice(np.setdiff1d(all_keys, absent), size=n_pairs, replace=False)
            values = rng.integers(half, vocab_size, size=n_pairs)
            tokens[row, start] = SEPARATOR
            tokens[row, start + 1:start + 1 + 2 * n_pairs:2] = keys
            tokens[row, start + 2:start + 2 + 2 * n_pairs:2] = values
            present = rng.choice(n_pairs, size=n_queries - n_absent, replace=False)
            asked = np.concatenate([keys[present], absent])
            answers = np.concatenate([values[present], np.full(n_absent, NONE)])
            is_stale = np.arange(n_queries) >= n_queries - n_absent
            order = rng.permutation(n_queries)
            where = slice(start + 1 + 2 * n_pairs, start + segment)
            tokens[row, where], targets[row, where] = asked[order], answers[order]
            stale[row, where] = is_stale[order] & (previous is not None)
            previous = keys
    return torch.from_numpy(tokens), torch.from_numpy(targets), torch.from_numpy(stale)


class DeltaNet(GatedDeltaNet):
    """The GDN layer without its forget gate (g ≡ 0): the plain delta rule, S_t = (I − β_t k_t k_tᵀ) S_{t-1} +
    β_t k_t v_tᵀ (DeltaNet). Everything else (short convs, L2-normalised q and k, β, output gate) as in GDN."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, **kwargs):
        super().__init__(d_model, n_heads, head_dim, **kwargs)
        del self.a_proj, self.A_log, self.dt_bias

    def log_decay(self, x):
        return x.new_zeros(*x.shape[:-1], self.n_heads)  # [B, T, H]


def pair_recall_error(rule: str, n_pairs: int, dim: int = 16, beta: float = 1.0, trials: int = 20,
                      seed: int = 0) -> float:
    """Mean relative error ‖Sᵀk_i − v_i‖² / ‖v_i‖² after writing ``n_pairs`` random pairs (unit keys in ``dim``
    dimensions) with ``rule`` ("linear attention" or "delta rule", step ``beta``), over ``trials`` seeded trials."""
    from k3course.reference import linear_attention as ref

    if rule not in ("linear attention", "delta rule"):
        raise ValueError(f"rule must be 'linear attention' or 'delta rule', got {rule!r}")
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((trials, n_pairs, 1, dim))
    keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
    values = rng.standard_normal((trials, n_pairs, 1, dim))
    if rule == "linear attention":
        _, state = ref.linear_attention(keys, keys, values)
    else:
        _, state = ref.delta_rule(keys, keys, values, np.full((trials, n_pairs, 1), beta))
    read = np.einsum("bhkv,bthk->bthv", state, keys)
    return float((np.square(read - values).sum(-1) / np.square(values).sum(-1)).mean())


FORGET_MIXERS = ("DeltaNet", "GDN")


def forget_model(mixer: str, vocab_size: int, **model_kwargs) -> RecallModel:
    """A :class:`~k3course.lessons.recall.RecallModel` with GDN layers (``"GDN"``) or, for ``"DeltaNet"``, the
    same model with :class:`DeltaNet` layers in their place."""
    if mixer not in FORGET_MIXERS:
        raise ValueError(f"mixer must be one of {FORGET_MIXERS}, got {mixer!r}")
    model = RecallModel(vocab_size, "GDN", **model_kwargs)
    if mixer == "DeltaNet":
        model.mixers = nn.ModuleList(DeltaNet(layer.d_model, layer.n_heads, layer.head_dim,
                                              chunk_size=layer.chunk_size) for layer in model.mixers)
    return model


@torch.no_grad()
def segment_accuracy(model: nn.Module, tokens, targets, stale) -> dict:
    """Arg-max accuracy on the queries of :func:`segment_recall`: ``{"stored", "stale"}`` — keys stored in the
    current segment (answer: the value), and keys stored only before the last separator (answer: NONE)."""
    correct = model(tokens).argmax(-1) == targets
    stored = (targets != IGNORE) & (targets != NONE)
    return {"stored": correct[stored].float().mean().item(), "stale": correct[stale].float().mean().item()}


def train_segment_recall(mixer: str, steps: int = 250, batch_size: int = 32, n_segments: int = 5, n_pairs: int = 3,
                         n_queries: int = 2, vocab_size: int = 32, lr: float = 5e-3, seed: int = 0,
                         **model_kwargs) -> dict:
    """Train a :func:`forget_model` on fresh :func:`segment_recall` batches (cross-entropy on the queries).

    Returns ``{"mixer", "losses", "accuracy", "model", "seconds"}`` with ``accuracy`` from
    :func:`segment_accuracy` on a held-out batch of 256 sequences, and the trained model. Seeded like
    :func:`k3course.lessons.recall.train_recall` (model under a forked RNG, batches seed·10⁶ + step, held-out
    10⁹ + seed).
    """
    _require_int("steps", steps, 1)
    task = dict(n_segments=n_segments, n_pairs=n_pairs, n_queries=n_queries, vocab_size=vocab_size)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = forget_model(mixer, vocab_size, **model_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    start = time.perf_counter()
    batch_at = lambda step: segment_recall(batch_size, seed=seed * 10**6 + step, **task)[:2]
    losses = fit(optimizer, steps, cross_entropy_at(model, batch_at), schedule_kind="one_cycle")
    accuracy = segment_accuracy(model, *segment_recall(256, seed=10**9 + seed, **task))
    return {"mixer": mixer, "losses": losses, "accuracy": accuracy, "model": model,
            "seconds": time.perf_counter() - start}


@torch.no_grad()
def retention_at_separators(model: RecallModel, tokens) -> dict:
    """Mean forget gate α = e^g of each layer and head ``[n_layers, H]``, at the separator tokens and at all
    other tokens of ``tokens [B, T]``: ``{"separator", "other"}``. Reads each mixer's input with a forward hook."""
    inputs = []
    hooks = [mixer.register_forward_pre_hook(lambda module, args: inputs.append(args[0])) for mixer in model.mixers]
    try:
        model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    alpha = torch.stack([mixer.log_decay(x).exp() for mixer, x in zip(model.mixers, inputs)])  # [L, B, T, H]
    at_separator = tokens == SEPARATOR
    return {"separator": alpha[:, at_separator].mean(1), "other": alpha[:, ~at_separator].mean(1)}


# --- lesson 06: the recall comparison over seeds -----------------------------------------------------------


def recall_seeds(mixers, seeds, progress: bool = True, **setting) -> dict:
    """:func:`k3course.lessons.recall.train_recall` for every mixer and seed: ``{mixer: [result per seed]}``.

    ``setting`` is passed to ``train_recall`` (steps, seq_len, n_pairs, vocab_size, d_model, n_heads, …).
    """
    mixers, seeds = list(mixers), list(seeds)
    if not mixers or not seeds:
        raise ValueError(f"mixers and seeds must be non-empty, got {mixers!r} and {seeds!r}")
    results = {mixer: [] for mixer in mixers}
    runs = [(mixer, seed) for seed in seeds for mixer in mixers]
    for mixer, seed in progress_bar(runs, desc="training", unit="model", disable=not progress):
        results[mixer].append(train_recall(mixer, seed=seed, **setting))
    return results
