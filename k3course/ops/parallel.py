"""Quadratic (attention-like) forms, for comparison with the recurrent and chunked ones.

Layouts as everywhere in :mod:`k3course.ops`: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``.
"""

from __future__ import annotations

import torch

from k3course.ops.checks import validate


def decay_attention_parallel(q, k, v, g, scale=None):
    """Decayed linear attention from a zero state, in parallel form (no loop over time):

    o_t = Σ_{s ≤ t} (Σ_d scale·q_td k_sd e^{G_td − G_sd}) v_s,  G = cumsum(g) over time (inclusive).

    g: ``[B, T, H]`` (scalar) or ``[B, T, H, K]`` (channel). Memory ``[B, H, T, T, K]``: for short T only.
    """
    gate = "scalar" if isinstance(g, torch.Tensor) and g.dim() == 3 else "channel"
    scale = validate(q, k, v, g, gate=gate, scale=scale)
    dtype, wide = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, g = (x.to(wide) for x in (q, k, v, g))
    if gate == "scalar":
        g = g.unsqueeze(-1).expand_as(q)
    G = g.cumsum(1).transpose(1, 2)  # [B, H, T, K]
    diff = G.unsqueeze(3) - G.unsqueeze(2)  # [B, H, T(t), T(s), K]: G_t − G_s, ≤ 0 for s ≤ t
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    weights = torch.exp(diff.clamp(max=0.0)) * causal[..., None]
    scores = torch.einsum("bhtd,bhsd,bhtsd->bhts", (q * scale).transpose(1, 2), k.transpose(1, 2), weights)
    return (scores @ v.transpose(1, 2)).transpose(1, 2).to(dtype)


def softmax_attention(q, k, v, scale=None):
    """Causal softmax attention, o_t = Σ_{s ≤ t} softmax_s(scale·q_t·k_s) v_s: the T² baseline for timings."""
    scale = validate(q, k, v, scale=scale)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, scale=scale)
    return o.transpose(1, 2)
