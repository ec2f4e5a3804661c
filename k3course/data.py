"""Synthetic data for the lessons.

Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"; the synthetic task Kimi Linear uses):
a sequence first lists key-value pairs, then asks for some of the keys again; at each query the model must
output the value that followed that key earlier. Recall needs a memory that stores many pairs at once and
retrieves them by content, which is what separates the token mixers of chapters 04–06.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE = -100  # target at positions that are not queries (torch's cross-entropy ignore_index)
FILLER = 0  # token between queries


def mqar(n_samples: int, seq_len: int, n_pairs: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded MQAR batch: ``(tokens [N, seq_len], targets [N, seq_len])``, both int64.

    Layout of one sequence: ``k_1 v_1 k_2 v_2 … k_n v_n`` then, in the remaining ``seq_len − 2n`` positions,
    the n keys again in a random order at random positions, filler token 0 elsewhere. Keys come from
    ``[1, vocab/2)``, values from ``[vocab/2, vocab)``, each key once per sequence. ``targets`` holds the
    value at each query position and ``IGNORE`` (−100) everywhere else.
    """
    half = vocab_size // 2
    if n_pairs < 1 or half - 1 < n_pairs:
        raise ValueError(f"n_pairs must be in [1, vocab_size/2 − 1] = [1, {half - 1}] (distinct keys), got {n_pairs}")
    if seq_len < 3 * n_pairs:
        raise ValueError(f"seq_len must be ≥ 3·n_pairs = {3 * n_pairs} (pairs, then one query per key), got {seq_len}")
    rng = np.random.default_rng(seed)
    tokens = np.full((n_samples, seq_len), FILLER, dtype=np.int64)
    targets = np.full((n_samples, seq_len), IGNORE, dtype=np.int64)
    for row in range(n_samples):
        keys = rng.choice(np.arange(1, half), size=n_pairs, replace=False)
        values = rng.integers(half, vocab_size, size=n_pairs)
        tokens[row, 0:2 * n_pairs:2], tokens[row, 1:2 * n_pairs:2] = keys, values
        asked = rng.permutation(n_pairs)  # which pair each query asks for
        where = 2 * n_pairs + np.sort(rng.choice(seq_len - 2 * n_pairs, size=n_pairs, replace=False))
        tokens[row, where], targets[row, where] = keys[asked], values[asked]
    return torch.from_numpy(tokens), torch.from_numpy(targets)
