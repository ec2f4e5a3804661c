"""Plausible wrong answers for chapter 06's full KDA layer."""

import torch
import torch.nn.functional as F

from k3course.ops import kda_recurrent


def _forward(layer, x, gate_before_norm=False, conv=True, l2=True, always_bounded=False):
    B, T, _ = x.shape
    H, D = layer.n_heads, layer.head_dim

    def mix(projected, weight):
        if not conv:
            return F.silu(projected)
        padded = F.pad(projected, (0, 0, weight.shape[1] - 1, 0))
        return F.silu(sum(padded[:, j:j + T] * weight[:, j] for j in range(weight.shape[1])))

    normalize = (lambda t: F.normalize(t, dim=-1)) if l2 else (lambda t: t)
    q = normalize(mix(layer.q_proj(x), layer.q_conv.weight).view(B, T, H, D))
    k = normalize(mix(layer.k_proj(x), layer.k_conv.weight).view(B, T, H, D))
    v = mix(layer.v_proj(x), layer.v_conv.weight).view(B, T, H, D)
    beta = torch.sigmoid(layer.b_proj(x))
    z = layer.f_proj(x).view(B, T, H, D) + layer.dt_bias
    rate = layer.A_log.exp()[:, None]
    if layer.lower_bound is None and not always_bounded:
        g = -rate * F.softplus(z)
    else:
        g = -5.0 * torch.sigmoid(rate * z)
    o, _ = kda_recurrent(q, k, v, g, beta)
    gate = torch.sigmoid(layer.gate_proj(x)).view(B, T, H, D)
    if gate_before_norm:
        return layer.o_proj(F.rms_norm(gate * o, (D,), layer.o_norm_weight, layer.norm_eps).flatten(-2))
    return layer.o_proj((gate * F.rms_norm(o, (D,), layer.o_norm_weight, layer.norm_eps)).flatten(-2))


def gate_on_the_wrong_side_of_the_norm(layer, x):
    return _forward(layer, x, gate_before_norm=True)


def without_the_short_convolution(layer, x):
    return _forward(layer, x, conv=False)


def keys_and_queries_not_normalised(layer, x):
    return _forward(layer, x, l2=False)


def bounded_gate_for_every_layer(layer, x):
    """K3's bounded gate also where the layer asks for Kimi Linear's softplus gate (lower_bound None)."""
    return _forward(layer, x, always_bounded=True)


WRONG = {"06.kda_layer_forward": [gate_on_the_wrong_side_of_the_norm, without_the_short_convolution,
                                  keys_and_queries_not_normalised, bounded_gate_for_every_layer]}
