"""Plausible wrong answers for chapter 02's latent MoE forward."""

import torch
import torch.nn.functional as F

from k3course.moe.experts import glu_ffn


def _forward(layer, x, biased_weights=False, latent_norm=True, norm_each_expert=False, shared_times=1):
    flat = x.reshape(-1, x.shape[-1])
    scores = torch.sigmoid(flat @ layer.router)
    chosen = torch.sort(scores + layer.bias, dim=-1, descending=True, stable=True).indices[:, :layer.top_k]
    weights = (scores + layer.bias if biased_weights else scores).gather(-1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * layer.route_scale
    latent = flat @ layer.down_proj
    combined = torch.zeros_like(latent)
    for j in range(layer.n_routed_experts):
        token, slot = torch.nonzero(chosen == j, as_tuple=True)
        out = glu_ffn(latent[token], layer.experts.gate[j], layer.experts.up[j], layer.experts.down[j], "situ_glu")
        if norm_each_expert:
            out = F.rms_norm(out, (out.shape[-1],), layer.latent_norm, layer.eps)
        combined = combined.index_add(0, token, weights[token, slot, None] * out)
    if latent_norm:
        combined = F.rms_norm(combined, (combined.shape[-1],), layer.latent_norm, layer.eps)
    y = combined @ layer.up_proj
    if layer.shared is not None:
        y = y + shared_times * glu_ffn(flat, layer.shared.gate, layer.shared.up, layer.shared.down, "situ_glu")
    return y.view(x.shape)


def shared_experts_added_twice(layer, x):
    return _forward(layer, x, shared_times=2)


def weights_from_biased_scores(layer, x):
    return _forward(layer, x, biased_weights=True)


def without_the_latent_norm(layer, x):
    return _forward(layer, x, latent_norm=False)


def norm_on_each_expert(layer, x):
    """Normalises every expert's output, then combines: RMSNorm belongs after the weighted sum."""
    return _forward(layer, x, latent_norm=False, norm_each_expert=True)


WRONG = {"02.latent_moe_forward": [shared_experts_added_twice, weights_from_biased_scores, without_the_latent_norm,
                                   norm_on_each_expert]}
