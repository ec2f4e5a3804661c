"""Plausible wrong answers for chapter 02."""

import torch
from torch.nn import functional as F


def situ_is_plain_swiglu(gate, up, beta1=4.0, beta2=25.0):
    return F.silu(gate) * up


def situ_caps_the_sigmoid_too(gate, up, beta1=4.0, beta2=25.0):
    capped = beta1 * torch.tanh(gate / beta1)
    return capped * torch.sigmoid(capped) * beta2 * torch.tanh(up / beta2)


def situ_swapped_betas(gate, up, beta1=4.0, beta2=25.0):
    return beta2 * torch.tanh(gate / beta2) * torch.sigmoid(gate) * beta1 * torch.tanh(up / beta1)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def combine_normalises_each_expert(expert_out, weights, up_proj, norm_weight, eps=1e-6):
    return torch.einsum("mk,mkl->ml", weights, _rms(expert_out, norm_weight, eps)) @ up_proj


def combine_forgets_the_norm_weight(expert_out, weights, up_proj, norm_weight, eps=1e-6):
    return _rms(torch.einsum("mk,mkl->ml", weights, expert_out), 1.0, eps) @ up_proj


def bytes_at_full_width(d_model, top_k, d_latent=None, bytes_per_value=2):
    return 2 * top_k * d_model * bytes_per_value


def bytes_dispatch_only(d_model, top_k, d_latent=None, bytes_per_value=2):
    return top_k * (d_latent or d_model) * bytes_per_value


WRONG = {
    "02.situ_glu": [situ_is_plain_swiglu, situ_caps_the_sigmoid_too, situ_swapped_betas],
    "02.latent_combine": [combine_normalises_each_expert, combine_forgets_the_norm_weight],
    "02.all_to_all_bytes_per_token": [bytes_at_full_width, bytes_dispatch_only],
}
