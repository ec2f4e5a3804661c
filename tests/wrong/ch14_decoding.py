"""Plausible wrong answers for chapter 14 (decoding at long context)."""

import math

from k3course import accounting


def kda_bytes_without_conv_tails(n_heads, head_k_dim, head_v_dim, conv_size, dtype_bytes, state_bytes=4):
    """Only the state: forgets the short-convolution tails."""
    return n_heads * head_k_dim * head_v_dim * state_bytes


def kda_bytes_state_in_activation_dtype(n_heads, head_k_dim, head_v_dim, conv_size, dtype_bytes, state_bytes=4):
    """Stores the state in the activations' dtype (it is fp32 whatever they are)."""
    return n_heads * (head_k_dim * head_v_dim + (conv_size - 1) * (2 * head_k_dim + head_v_dim)) * dtype_bytes


def kda_bytes_tails_all_k_wide(n_heads, head_k_dim, head_v_dim, conv_size, dtype_bytes, state_bytes=4):
    """Three K-wide tails (v's tail is V wide)."""
    return n_heads * (head_k_dim * head_v_dim * state_bytes + (conv_size - 1) * 3 * head_k_dim * dtype_bytes)


def mla_bytes_without_rope(context, kv_lora_rank, qk_rope_head_dim, dtype_bytes):
    """Forgets the shared rope key."""
    return context * kv_lora_rank * dtype_bytes


def mla_bytes_in_numbers(context, kv_lora_rank, qk_rope_head_dim, dtype_bytes):
    """Counts numbers, not bytes."""
    return context * (kv_lora_rank + qk_rope_head_dim)


def crossover_ignores_the_state(cfg, dtype_bytes=2):
    """Without the KDA state the hybrid is smaller from the first token."""
    return 1


def crossover_state_in_activation_dtype(cfg, dtype_bytes=2):
    """Counts the KDA state in the activations' dtype (it is fp32)."""
    per_token = accounting.kv_cache_bytes_per_token
    gap = per_token(cfg.all_mla(), dtype_bytes) - per_token(cfg, dtype_bytes)
    return accounting.recurrent_state_bytes(cfg, dtype_bytes, state_bytes=dtype_bytes) // gap + 1


def crossover_against_all_mla_growth(cfg, dtype_bytes=2):
    """Divides the state by all-MLA's growth per token instead of the difference of growths."""
    all_mla_growth = accounting.kv_cache_bytes_per_token(cfg.all_mla(), dtype_bytes)
    return accounting.recurrent_state_bytes(cfg, dtype_bytes) // all_mla_growth + 1


def extrapolate_through_origin(contexts, seconds, target):
    """Scales the last point: t(target) = t_last · target / L_last (ignores the context-free weight reads)."""
    return seconds[-1] * target / contexts[-1]


def extrapolate_from_end_points(contexts, seconds, target):
    """The line through the first and last points only (not a least-squares fit)."""
    slope = (seconds[-1] - seconds[0]) / (contexts[-1] - contexts[0])
    return seconds[0] + slope * (target - contexts[0])


def crossover_rounds_up(cfg, dtype_bytes=2):
    """⌈s / gap⌉ instead of ⌊s / gap⌋ + 1: one token short when the division is exact (equal, not below)."""
    per_token = accounting.kv_cache_bytes_per_token
    gap = per_token(cfg.all_mla(), dtype_bytes) - per_token(cfg, dtype_bytes)
    return math.ceil(accounting.recurrent_state_bytes(cfg, dtype_bytes) / gap)


WRONG = {
    "14.kda_step_bytes": [kda_bytes_without_conv_tails, kda_bytes_state_in_activation_dtype,
                          kda_bytes_tails_all_k_wide],
    "14.mla_step_bytes": [mla_bytes_without_rope, mla_bytes_in_numbers],
    "14.crossover_context": [crossover_ignores_the_state, crossover_state_in_activation_dtype,
                             crossover_against_all_mla_growth, crossover_rounds_up],
    "14.extrapolate_tpot": [extrapolate_through_origin, extrapolate_from_end_points],
}
