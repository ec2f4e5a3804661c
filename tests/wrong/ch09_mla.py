"""Plausible wrong answers for chapter 09 (gated MLA)."""

import torch


def compress_kv_norm_includes_rope(x, kv_down_weight, kv_norm_weight, kv_lora_rank):
    """RMSNorm over the whole [c_KV ; k_rope] before splitting (the rope key must stay unnormalised)."""
    compressed = x @ kv_down_weight.T
    rms = compressed.square().mean(-1, keepdim=True).add(1e-6).rsqrt()
    normed = compressed * rms
    return normed[..., :kv_lora_rank] * kv_norm_weight, normed[..., kv_lora_rank:]


def compress_kv_no_norm(x, kv_down_weight, kv_norm_weight, kv_lora_rank):
    """Forgets the RMSNorm on the latent."""
    compressed = x @ kv_down_weight.T
    return compressed[..., :kv_lora_rank], compressed[..., kv_lora_rank:]


def _scores(q_nope, q_rope, k_nope, k_rope):
    return torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthe,bse->bhts", q_rope, k_rope)


def _causal(scores):
    t, s = scores.shape[-2:]
    return scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))


def probs_scale_nope_only(q_nope, q_rope, k_nope, k_rope):
    """Scale 1/sqrt(nope) instead of 1/sqrt(nope + rope)."""
    return torch.softmax(_causal(_scores(q_nope, q_rope, k_nope, k_rope) * q_nope.shape[-1] ** -0.5), dim=-1)


def probs_softmax_over_queries(q_nope, q_rope, k_nope, k_rope):
    """Softmax over the query axis instead of the keys."""
    scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5
    return torch.softmax(_causal(_scores(q_nope, q_rope, k_nope, k_rope) * scale), dim=-2).nan_to_num()


def probs_not_causal(q_nope, q_rope, k_nope, k_rope):
    """Forgets the causal mask."""
    scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5
    return torch.softmax(_scores(q_nope, q_rope, k_nope, k_rope) * scale, dim=-1)


def absorb_query_scaled(q_nope, k_up):
    """Folds the softmax scale 1/sqrt(nope) into the absorbed query as well (it is applied to the scores)."""
    return torch.einsum("bthn,hnr->bthr", q_nope, k_up) * q_nope.shape[-1] ** -0.5


def absorb_query_first_head(q_nope, k_up):
    """Uses head 0's W_UK for every head."""
    return torch.einsum("bthn,nr->bthr", q_nope, k_up[0])


def cache_full_keys_and_values(n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank):
    """Caches the up-projected per-head keys and values, as MHA would."""
    return n_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)


def cache_rope_per_head(n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank):
    """Counts a rope key per head (it is shared by all heads)."""
    return kv_lora_rank + n_heads * qk_rope_head_dim



def compress_kv_eps_outside_sqrt(x, kv_down_weight, kv_norm_weight, kv_lora_rank):
    """c / (sqrt(mean c²) + eps): the same as RMSNorm unless the latent is tiny."""
    compressed = x @ kv_down_weight.T
    latent = compressed[..., :kv_lora_rank]
    latent = latent / (latent.square().mean(-1, keepdim=True).sqrt() + 1e-6) * kv_norm_weight
    return latent, compressed[..., kv_lora_rank:]


def probs_softmax_without_max(q_nope, q_rope, k_nope, k_rope):
    """softmax as e^s / Σ e^s without subtracting the row max: inf / inf = NaN for large scores."""
    scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5
    e = torch.exp(_causal(_scores(q_nope, q_rope, k_nope, k_rope) * scale).float())
    return e / e.sum(-1, keepdim=True)


def probs_in_input_dtype(q_nope, q_rope, k_nope, k_rope):
    """Softmax in the inputs' dtype (bfloat16 weights; the exercise asks for fp32)."""
    scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5
    return torch.softmax(_causal(_scores(q_nope, q_rope, k_nope, k_rope) * scale), dim=-1)


def absorb_query_in_float32(q_nope, k_up):
    """Casts to float32 whatever the input dtype."""
    return torch.einsum("bthn,hnr->bthr", q_nope.float(), k_up.float())


def probs_future_masked_with_minus_1e4(q_nope, q_rope, k_nope, k_rope, scale=None, start=0):
    """Masks the future with −10⁴ instead of −inf: right until every visible score of a row is below −10⁴."""
    if scale is None:
        scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5
    nope = "bthn,bshn->bhts" if k_nope.dim() == 4 else "bthn,bsn->bhts"
    scores = (torch.einsum(nope, q_nope, k_nope) + torch.einsum("bthe,bse->bhts", q_rope, k_rope)) * scale
    T, S = scores.shape[-2:]
    visible = torch.arange(S)[None, :] <= start + torch.arange(T)[:, None]
    wide = scores.to(torch.promote_types(scores.dtype, torch.float32))
    return torch.softmax(wide.masked_fill(~visible, -1e4), dim=-1)

WRONG = {
    "09.compress_kv": [compress_kv_norm_includes_rope, compress_kv_no_norm, compress_kv_eps_outside_sqrt],
    "09.attention_probs": [probs_scale_nope_only, probs_softmax_over_queries, probs_not_causal,
                           probs_softmax_without_max, probs_in_input_dtype, probs_future_masked_with_minus_1e4],
    "09.absorb_query": [absorb_query_scaled, absorb_query_first_head, absorb_query_in_float32],
    "09.mla_cache_numbers": [cache_full_keys_and_values, cache_rope_per_head],
}
