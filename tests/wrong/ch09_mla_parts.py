"""Plausible wrong answers for chapter 09's output gate and gated MLA forward."""

import torch
import torch.nn.functional as F

from k3course.layers.mla import rope_rotate


def silu_gate(heads, x, gate_weight):
    return F.silu(x @ gate_weight.T) * heads


def gate_read_from_the_heads(heads, x, gate_weight):
    """σ of the attention output itself instead of σ(x W_Gᵀ)."""
    return torch.sigmoid(heads) * heads


def one_minus_the_gate(heads, x, gate_weight):
    return (1 - torch.sigmoid(x @ gate_weight.T)) * heads


def gate_in_float32(heads, x, gate_weight):
    return torch.sigmoid(x.float() @ gate_weight.float().T) * heads.float()


def _forward(layer, x, causal=True, gate=True, rope=True, scale_dims=None):
    B, T, _ = x.shape
    H, nope, rope_dim, rank = layer.n_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.kv_lora_rank
    positions = torch.arange(T)
    c_q = x if layer.q_down is None else layer.q_norm(layer.q_down(x))
    q_nope, q_rope = layer.q_up(c_q).view(B, T, H, nope + rope_dim).split([nope, rope_dim], dim=-1)
    compressed = layer.kv_down(x)
    latent, k_rope = layer.kv_norm(compressed[..., :rank]), compressed[..., rank:]
    if layer.use_rope and rope:
        q_rope, k_rope = rope_rotate(q_rope, positions), rope_rotate(k_rope, positions)
    k_nope = torch.einsum("bsr,hnr->bshn", latent, layer.k_up)
    values = torch.einsum("bsr,hvr->bshv", latent, layer.v_up)
    scores = (torch.einsum("bthn,bshn->bhts", q_nope, k_nope)
              + torch.einsum("bthe,bse->bhts", q_rope, k_rope)) * (scale_dims or nope + rope_dim) ** -0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    heads = torch.einsum("bhts,bshv->bthv", torch.softmax(scores, -1), values).flatten(2)
    if layer.gated and gate:
        heads = torch.sigmoid(layer.gate(x)) * heads
    return layer.out(heads)


def no_causal_mask(layer, x):
    return _forward(layer, x, causal=False)


def output_gate_left_out(layer, x):
    return _forward(layer, x, gate=False)


def rope_never_applied(layer, x):
    return _forward(layer, x, rope=False)


def scaled_by_the_nope_dims_only(layer, x):
    return _forward(layer, x, scale_dims=layer.qk_nope_head_dim)


WRONG = {"09.mla_output_gate": [silu_gate, gate_read_from_the_heads, one_minus_the_gate, gate_in_float32],
         "09.gated_mla_forward": [no_causal_mask, output_gate_left_out, rope_never_applied,
                                  scaled_by_the_nope_dims_only]}
