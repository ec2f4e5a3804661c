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


def bytes_at_full_width(d_model, top_k, latent_dim=None, bytes_per_value=2):
    return 2 * top_k * d_model * bytes_per_value


def bytes_dispatch_only(d_model, top_k, latent_dim=None, bytes_per_value=2):
    return top_k * (latent_dim or d_model) * bytes_per_value



def situ_tanh_from_exp(gate, up, beta1=4.0, beta2=25.0):
    """tanh written as (e^{2x} − 1) / (e^{2x} + 1): inf / inf = NaN for large inputs."""
    def tanh(x):
        e = torch.exp(2 * x)
        return (e - 1) / (e + 1)
    return beta1 * tanh(gate / beta1) * torch.sigmoid(gate) * beta2 * tanh(up / beta2)


def combine_eps_outside_sqrt(expert_out, weights, up_proj, norm_weight, eps=1e-6):
    """u / (sqrt(mean u²) + eps): the same as the reference unless the sum is tiny."""
    u = torch.einsum("mk,mkl->ml", weights, expert_out)
    return u / (u.square().mean(-1, keepdim=True).sqrt() + eps) * norm_weight @ up_proj


def combine_in_float32(expert_out, weights, up_proj, norm_weight, eps=1e-6):
    """Casts everything to float32."""
    u = torch.einsum("mk,mkl->ml", weights.float(), expert_out.float())
    return _rms(u, norm_weight.float(), eps) @ up_proj.float()


def combine_weighted_mean(expert_out, weights, up_proj, norm_weight, eps=1e-6):
    """Divides by the weights' sum: the norm hides it, except where eps matters (tiny outputs, weights that do
    not sum to 1)."""
    u = torch.einsum("mk,mkl->ml", weights, expert_out) / weights.sum(-1, keepdim=True)
    return _rms(u, norm_weight, eps) @ up_proj


WRONG = {
    "02.situ_glu": [situ_is_plain_swiglu, situ_caps_the_sigmoid_too, situ_swapped_betas, situ_tanh_from_exp],
    "02.latent_combine": [combine_normalises_each_expert, combine_forgets_the_norm_weight, combine_eps_outside_sqrt,
                          combine_in_float32, combine_weighted_mean],
    "02.all_to_all_bytes_per_token": [bytes_at_full_width, bytes_dispatch_only],
}
