"""Chapter 11: the assembled model. Each function is a number a lesson quotes (see :mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

import math

from k3course.config import K3Config
from k3course.lessons.quoted.markers import quoted
from k3course.lessons.quoted.size import preset_count


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
    parts = preset_count(name).components
    return (parts["embedding"][0] + parts["lm_head"][0]) / 1e9


@quoted
def uniform_loss(vocab: int = 256) -> float:
    """The loss of a uniform guess over ``vocab`` tokens, ln vocab (nats)."""
    return math.log(vocab)
