"""Rung 1: the token mixers as recurrences in torch, one step per token (lessons 04–06).

The ``*_step`` functions advance one token for a batch of heads: state ``[B, H, K, V]``, q/k ``[B, H, K]``,
v ``[B, H, V]``, beta ``[B, H]``, g ``[B, H]`` (scalar gate) or ``[B, H, K]`` (channel gate); each returns
``(o_t [B, H, V], new_state)`` with ``o_t = S_tᵀ q_t`` (q already scaled). They do no input checks: the
sequence ops below validate once and then loop.

The sequence ops follow fla's signature ``(q, k, v, g, beta, scale=None, initial_state=None,
output_final_state=False) -> (o, final_state)`` with layouts from :mod:`k3course.ops.checks`. They
compute in float32 whatever the input dtype (float64 stays float64), return ``o`` in the input dtype and the
final state in that precision (``None`` unless ``output_final_state``).
"""

from __future__ import annotations

import torch

from k3course.ops.checks import float32_recurrence, validate
from k3course.parts import part


def _read(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Sᵀx for a batch of heads: state ``[B, H, K, V]``, x ``[B, H, K]`` -> ``[B, H, V]``."""
    return torch.einsum("bhkv,bhk->bhv", state, x)


def _outer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k vᵀ: ``[B, H, K]``, ``[B, H, V]`` -> ``[B, H, K, V]``."""
    return k.unsqueeze(-1) * v.unsqueeze(-2)


def _decay_state(state: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Diag(e^g) S with g ``[B, H]`` (one rate per head) or ``[B, H, K]`` (one rate per key channel)."""
    alpha = g.exp()
    alpha = alpha[..., None, None] if g.dim() == 2 else alpha[..., None]
    return alpha * state


def decay_step(state, q, k, v, g):
    """Decayed linear attention, one token: S_t = Diag(e^{g_t}) S_{t-1} + k_t v_tᵀ;  o_t = S_tᵀ q_t.

    g = 0 is plain linear attention; g ``[B, H]`` is a scalar gate per head, ``[B, H, K]`` is GLA.
    """
    state = _decay_state(state, g) + _outer(k, v)
    return _read(state, q), state


def delta_step(state, q, k, v, beta):
    """Delta rule, one token: S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ = (I − β k kᵀ) S + β k vᵀ;  o_t = S_tᵀ q_t.

    One SGD step, learning rate β, on the regression loss ½‖Sᵀk_t − v_t‖².
    """
    error = v - _read(state, k)  # [B, H, V]
    state = state + _outer(beta.unsqueeze(-1) * k, error)
    return _read(state, q), state


def gdn_step(state, q, k, v, g, beta):
    """Gated DeltaNet, one token: S_t = e^{g_t} (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ, g ``[B, H]``."""
    return delta_step(_decay_state(state, g), q, k, v, beta)


def kda_step(state, q, k, v, g, beta):
    """KDA, one token: S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t-1} + β_t k_t v_tᵀ, g ``[B, H, K]``.

    Decay first, then the delta correction against the decayed state.
    """
    return delta_step(_decay_state(state, g), q, k, v, beta)


def _run(step, q, k, v, gates: tuple, scale, initial_state, output_final_state):
    """Loop ``step`` over time in float32 (float64 stays float64); gates are the per-token tensors after v
    (g, beta, ...)."""
    with float32_recurrence(q.device):  # under autocast too
        dtype, wide = q.dtype, torch.promote_types(q.dtype, torch.float32)
        q, k, v = (x.to(wide) for x in (q, k, v))
        gates = tuple(x.to(wide) for x in gates)
        batch, time, heads, key_dim = q.shape
        state = q.new_zeros(batch, heads, key_dim, v.shape[-1])
        if initial_state is not None:
            state = state + initial_state.to(wide)
        q = q * scale
        outputs = []
        for t in range(time):
            o_t, state = step(state, q[:, t], k[:, t], v[:, t], *(x[:, t] for x in gates))
            outputs.append(o_t)
        o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
        return o.to(dtype), (state if output_final_state else None)


def gla_recurrent(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Decayed linear attention over a sequence: S_t = Diag(e^{g_t}) S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ(scale·q_t).

    g: ``[B, T, H]`` (scalar decay per head) or ``[B, T, H, K]`` (GLA); g = 0 gives plain linear attention.
    Returns ``o [B, T, H, V]`` and the final state ``[B, H, K, V]`` (or None).
    """
    gate = "scalar" if isinstance(g, torch.Tensor) and g.dim() == 3 else "channel"
    scale = validate(q, k, v, g, gate=gate, scale=scale, initial_state=initial_state)
    return _run(decay_step, q, k, v, (g,), scale, initial_state, output_final_state)


def gdn_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
                  allow_neg_eigval=False):
    """Gated DeltaNet over a sequence, g ``[B, T, H]``: S_t = e^{g_t}(I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ.

    DeltaNet is g = 0. ``allow_neg_eigval`` admits β ∈ [0, 2]. Returns ``o [B, T, H, V]`` and the final
    state ``[B, H, K, V]`` (or None).
    """
    scale = validate(q, k, v, g, beta, gate="scalar", scale=scale, initial_state=initial_state,
                     allow_neg_eigval=allow_neg_eigval)
    return _run(gdn_step, q, k, v, (g, beta), scale, initial_state, output_final_state)


def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
                  allow_neg_eigval=False):
    """Kimi Delta Attention over a sequence, g ``[B, T, H, K]``:

    S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t-1} + β_t k_t v_tᵀ,  o_t = S_tᵀ (scale·q_t).

    ``allow_neg_eigval`` admits β ∈ [0, 2] (the transition may then flip a direction's sign).
    Returns ``o [B, T, H, V]`` (input dtype) and the final state ``[B, H, K, V]`` in float32, float64 for
    float64 inputs (or None).
    """
    scale = validate(q, k, v, g, beta, gate="channel", scale=scale, initial_state=initial_state,
                     allow_neg_eigval=allow_neg_eigval)
    return _run(part("kda_step", kda_step), q, k, v, (g, beta), scale, initial_state, output_final_state)
