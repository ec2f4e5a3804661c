"""Rung 0 of the MoE track: a mixture of experts in NumPy, one token at a time, written to be read.

Everything here is float64 and uses explicit Python loops over tokens and experts, so each line maps to one
term of the equations in lessons 01–03. The torch rung in :mod:`k3course.moe` computes the same things in
batches; the tests hold the two to ~1e-5 relative.

Shapes: ``m`` tokens, ``n`` routed experts, ``k`` experts per token, ``d`` model width, ``l`` latent width,
``h`` expert inner width.

Parameters of a layer travel as a dict of arrays (the names match :class:`k3course.moe.MoE`):

- ``router``  [d, n]; ``bias`` [n] (selection only)
- ``w_gate``, ``w_up`` [n, d_in, h]; ``w_down`` [n, h, d_in] with d_in = l for a latent layer, else d
- ``shared_gate``, ``shared_up`` [d, h_s]; ``shared_down`` [h_s, d] (absent without shared experts)
- ``w_down_proj`` [d, l]; ``w_up_proj`` [l, d]; ``latent_norm`` [l] (latent layer only)
"""

from __future__ import annotations

import numpy as np


def sigmoid(x: np.ndarray) -> np.ndarray:
    """σ(x) = 1 / (1 + e^-x), elementwise."""
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    """softmax over the last axis, shifted by the max for stability."""
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def router_scores(x: np.ndarray, router: np.ndarray, router_score: str = "sigmoid") -> np.ndarray:
    """s = σ(x W_r) (K3, DeepSeek-V3) or softmax(x W_r) (Switch, Mixtral). x [m, d], router [d, n] -> [m, n]."""
    logits = x @ router
    if router_score == "sigmoid":
        return sigmoid(logits)
    if router_score == "softmax":
        return softmax(logits)
    raise ValueError(f"router_score must be 'sigmoid' or 'softmax', got {router_score!r}")


def top_indices(row: np.ndarray, k: int) -> list[int]:
    """The k largest entries of a 1-D row, largest first; ties go to the lower index."""
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))
    return order[:k]


def topk_route(scores: np.ndarray, k: int, bias: np.ndarray | None = None,
               renormalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Choose k experts per token on s + b; weight them with the UNBIASED scores.

    idx_t = TopK_j(s_tj + b_j);  p_tj = s_tj / Σ_{i ∈ idx_t} s_ti  (or s_tj without renormalisation).
    scores [m, n], bias [n] -> (expert_idx [m, k] int64, weights [m, k]).
    """
    m, n = scores.shape
    bias = np.zeros(n) if bias is None else bias
    expert_idx = np.zeros((m, k), dtype=np.int64)
    weights = np.zeros((m, k))
    for t in range(m):
        chosen = top_indices(scores[t] + bias, k)  # the bias only steers this choice
        expert_idx[t] = chosen
        weights[t] = scores[t, chosen]
        if renormalize:
            weights[t] /= weights[t].sum()
    return expert_idx, weights


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU(x) = x σ(x)."""
    return x * sigmoid(x)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU's elementwise part: SiLU(gate) ⊙ up."""
    return silu(gate) * up


def situ_glu(gate: np.ndarray, up: np.ndarray, beta1: float = 4.0, beta2: float = 25.0) -> np.ndarray:
    """K3's SiTU-GLU: [β₁ tanh(gate/β₁) ⊙ σ(gate)] ⊙ [β₂ tanh(up/β₂)] (a soft-capped SwiGLU)."""
    return beta1 * np.tanh(gate / beta1) * sigmoid(gate) * (beta2 * np.tanh(up / beta2))


ACTIVATIONS = {"swiglu": swiglu, "situ_glu": situ_glu}


def glu_ffn(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
            activation: str = "swiglu") -> np.ndarray:
    """One gated FFN (an expert): (act(x W_g, x W_u)) W_d. x [..., d_in]; w_gate, w_up [d_in, h]; w_down [h, d_in]."""
    return ACTIVATIONS[activation](x @ w_gate, x @ w_up) @ w_down


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """RMSNorm(x) = x / sqrt(mean(x²) + eps) ⊙ weight, over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def moe_forward(x: np.ndarray, params: dict, top_k: int, router_score: str = "sigmoid", activation: str = "swiglu",
                route_scale: float = 1.0, renormalize: bool = True, eps: float = 1e-6) -> np.ndarray:
    """A (latent) MoE layer, token by token.

    y_t = shared(x_t) + W↑ RMSNorm(u_t) with u_t = route_scale · Σ_{j ∈ idx_t} p_tj E_j(W↓ x_t)   (latent)
    y_t = shared(x_t) + u_t                with E_j applied to x_t itself                              (plain)
    The router and the shared experts always read the full-width x_t. x [m, d] -> y [m, d].
    """
    latent = "w_down_proj" in params
    scores = router_scores(x, params["router"], router_score)
    expert_idx, weights = topk_route(scores, top_k, params.get("bias"), renormalize)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        expert_input = x[t] @ params["w_down_proj"] if latent else x[t]
        u = np.zeros_like(expert_input)
        for slot in range(top_k):
            j = expert_idx[t, slot]
            expert_out = glu_ffn(expert_input, params["w_gate"][j], params["w_up"][j], params["w_down"][j],
                                 activation)
            u += route_scale * weights[t, slot] * expert_out
        y[t] = rms_norm(u, params["latent_norm"], eps) @ params["w_up_proj"] if latent else u
        if "shared_gate" in params:
            y[t] += glu_ffn(x[t], params["shared_gate"], params["shared_up"], params["shared_down"], activation)
    return y


# --- balancing ------------------------------------------------------------------------------------------

def expert_load(expert_idx: np.ndarray, n: int) -> np.ndarray:
    """How many token-slots each of the n experts received: load_j = #{(t, slot): idx[t, slot] = j}."""
    load = np.zeros(n, dtype=np.int64)
    for j in expert_idx.reshape(-1):
        load[j] += 1
    return load


def switch_aux_loss(probs: np.ndarray, expert_idx: np.ndarray, alpha: float = 1.0) -> float:
    """Switch load-balancing loss α · n · Σ_j f_j P_j.

    f_j = load_j / (m k) is the fraction of token-slots sent to j; P_j = mean_t probs[t, j].
    probs [m, n] (router probabilities, rows summing to 1); expert_idx [m, k].
    """
    m, n = probs.shape
    fraction = expert_load(expert_idx, n) / expert_idx.size
    mean_prob = probs.sum(axis=0) / m
    return float(alpha * n * sum(fraction[j] * mean_prob[j] for j in range(n)))


def router_z_loss(logits: np.ndarray) -> float:
    """Router z-loss (ST-MoE): mean_t (log Σ_j e^{logit_tj})²."""
    total = 0.0
    for row in logits:
        top = row.max()
        total += (top + np.log(np.exp(row - top).sum())) ** 2
    return total / logits.shape[0]


def sign_rule_update(bias: np.ndarray, load: np.ndarray, gamma: float) -> np.ndarray:
    """DeepSeek-V3's loss-free balancing: b_j ← b_j − γ · sign(load_j − mean load)."""
    return bias - gamma * np.sign(load - load.mean())


def quantile_balance_bias(scores: np.ndarray, bias: np.ndarray, k: int) -> np.ndarray:
    """K3's quantile balancing: one coordinate step on the dual of the balanced-assignment LP.

    α_t = the (k+1)-th largest of s_t + b (each token's cutoff); q = ⌊m k / n⌋ (the target load);
    b̂_j = −(the (q+1)-th largest over tokens t of s_tj − α_t);  return b̂ − mean(b̂).
    scores [m, n], bias [n] -> new bias [n].
    """
    m, n = scores.shape
    target = (m * k) // n
    cutoff = np.zeros(m)
    for t in range(m):
        cutoff[t] = sorted(scores[t] + bias, reverse=True)[k]  # (k+1)-th largest
    new_bias = np.zeros(n)
    for j in range(n):
        margins = sorted((scores[t, j] - cutoff[t] for t in range(m)), reverse=True)
        new_bias[j] = -margins[target]  # (q+1)-th largest
    return new_bias - new_bias.mean()
