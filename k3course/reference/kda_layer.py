"""Rung 0 of the KDA layer: the whole token mixer in NumPy float64, one sequence at a time.

For x ∈ R^{T×d} (H heads, head dim D = K = V, W = conv width):

    q̂ = SiLU(ShortConv_W(x W_q)),  k̂ = SiLU(ShortConv_W(x W_k)),  v = SiLU(ShortConv_W(x W_v))   causal, depthwise
    q = q̂ / ‖q̂‖,  k = k̂ / ‖k̂‖                        per head (the L2 norm makes k kᵀ a projection)
    β = σ(x W_β)                                       [T, H]
    z = (x W_f1) W_f2                                  low-rank, [T, H, K]
    g = lower · σ(e^{A_log} ⊙ (z + dt_bias))          K3 (bounded, g ∈ (lower, 0)); the bias sits INSIDE the rate
    g = −e^{A_log} ⊙ softplus(z + dt_bias)             Kimi Linear (lower = None)
    o = KDA(q, k, v, g, β)                             the recurrence of :func:`k3course.reference.linear_attention.kda`
    y = (σ(x W_g) ⊙ RMSNorm_head(o) ⊙ w_norm) W_o      sigmoid output gate (full rank, or low rank with a bias)

Weights are taken from a torch layer by :func:`layer_weights` (as float64 arrays, under the names below), so the
tests compare the two on the same weights.
"""

from __future__ import annotations

import numpy as np

from k3course.reference.linear_attention import kda


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # σ without overflow for large |x|


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def short_conv(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Causal depthwise conv: y_t[c] = Σ_j weight[c, j] x_{t−(W−1)+j}[c], zeros before t = 0.

    x [T, C], weight [C, W] -> [T, C]."""
    width = weight.shape[1]
    padded = np.concatenate([np.zeros((width - 1, x.shape[1])), x])
    return np.stack([(padded[t:t + width] * weight.T).sum(0) for t in range(x.shape[0])])


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """x / max(‖x‖, eps) over the last axis (torch's F.normalize)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def kda_gate(z: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray, lower_bound: float | None) -> np.ndarray:
    """The forget gate g from z [T, H, K], A_log [H], dt_bias [H, K]: bounded (K3) or softplus (Kimi Linear)."""
    rate = np.exp(A_log)[:, None]
    if lower_bound is None:
        return -rate * softplus(z + dt_bias)
    return lower_bound * sigmoid(rate * (z + dt_bias))


def kda_layer(x: np.ndarray, w: dict, n_heads: int, lower_bound: float | None = -5.0,
              eps: float = 1e-6) -> np.ndarray:
    """The KDA token mixer on one sequence x [T, d] with weights ``w`` (see :func:`layer_weights`) -> y [T, d]."""
    x = np.asarray(x, dtype=np.float64)
    T, heads = x.shape[0], n_heads
    split = lambda a: a.reshape(T, heads, -1)  # [T, H·D] -> [T, H, D]
    q = l2_normalize(split(silu(short_conv(x @ w["q_proj"], w["q_conv"]))))
    k = l2_normalize(split(silu(short_conv(x @ w["k_proj"], w["k_conv"]))))
    v = split(silu(short_conv(x @ w["v_proj"], w["v_conv"])))
    beta = sigmoid(x @ w["b_proj"])
    g = kda_gate(split(x @ w["f_proj_down"] @ w["f_proj_up"]), w["A_log"], w["dt_bias"], lower_bound)
    o, _ = kda(q[None], k[None], v[None], g[None], beta[None])
    o = o[0]  # [T, H, V]
    o = o / np.sqrt((o ** 2).mean(-1, keepdims=True) + eps) * w["o_norm"]
    gate = x @ w["gate_proj"] if "gate_proj" in w else (x @ w["gate_down"]) @ w["gate_up"] + w["gate_bias"]
    return (sigmoid(gate) * o.reshape(T, -1)) @ w["o_proj"]


def layer_weights(layer) -> dict:
    """A torch KimiDeltaAttention's weights as float64 arrays, each laid out for ``x @ W``."""
    as_np = lambda t: t.detach().cpu().double().numpy()
    w = {"q_proj": as_np(layer.q_proj.weight.T), "k_proj": as_np(layer.k_proj.weight.T),
         "v_proj": as_np(layer.v_proj.weight.T), "q_conv": as_np(layer.q_conv.weight),
         "k_conv": as_np(layer.k_conv.weight), "v_conv": as_np(layer.v_conv.weight),
         "b_proj": as_np(layer.b_proj.weight.T), "f_proj_down": as_np(layer.f_proj[0].weight.T),
         "f_proj_up": as_np(layer.f_proj[1].weight.T), "A_log": as_np(layer.A_log), "dt_bias": as_np(layer.dt_bias),
         "o_norm": as_np(layer.o_norm_weight), "o_proj": as_np(layer.o_proj.weight.T)}
    if isinstance(layer.gate_proj, type(layer.o_proj)):
        w["gate_proj"] = as_np(layer.gate_proj.weight.T)
    else:
        w |= {"gate_down": as_np(layer.gate_proj[0].weight.T), "gate_up": as_np(layer.gate_proj[1].weight.T),
              "gate_bias": as_np(layer.gate_proj[1].bias)}
    return w
