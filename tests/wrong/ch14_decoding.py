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


def _weights_for(cfg, experts_per_layer, dtype_bytes):
    """Weight bytes of a step that runs ``experts_per_layer`` routed experts in each MoE layer."""
    count = accounting.param_count(cfg)
    routed_total, routed_active = count.components["routed_experts"]
    per_expert = routed_total / (cfg.n_routed_experts * cfg.n_moe_layers)
    return (count.active - routed_active + cfg.n_moe_layers * experts_per_layer * per_expert) * dtype_bytes


def _touched(cfg, batch):
    return cfg.n_routed_experts * (1 - (1 - cfg.top_k / cfg.n_routed_experts) ** batch)


def tpot_flops_only(cfg, context, batch, bandwidth, flops_per_s, dtype_bytes=2):
    """Times the FLOPs only: a decode step is FLOP-bound (it is bandwidth-bound at small batch)."""
    return batch * accounting.decode_flops_per_token(cfg, context) / flops_per_s


def tpot_adds_bytes_and_flops(cfg, context, batch, bandwidth, flops_per_s, dtype_bytes=2):
    """Adds the two times: reading and computing one after the other, not overlapped."""
    cache = batch * accounting.kv_cache_bytes(cfg, context, dtype_bytes)
    flops = batch * accounting.decode_flops_per_token(cfg, context)
    return (_weights_for(cfg, _touched(cfg, batch), dtype_bytes) + cache) / bandwidth + flops / flops_per_s


def tpot_experts_of_one_token(cfg, context, batch, bandwidth, flops_per_s, dtype_bytes=2):
    """Reads the active weights of one token (top_k experts a layer) whatever the batch touches."""
    cache = batch * accounting.kv_cache_bytes(cfg, context, dtype_bytes)
    flops = batch * accounting.decode_flops_per_token(cfg, context)
    return max((accounting.param_count(cfg).active * dtype_bytes + cache) / bandwidth, flops / flops_per_s)


def tpot_every_token_new_experts(cfg, context, batch, bandwidth, flops_per_s, dtype_bytes=2):
    """min(n, B·k) experts a layer: as if no two tokens of the batch shared an expert."""
    cache = batch * accounting.kv_cache_bytes(cfg, context, dtype_bytes)
    flops = batch * accounting.decode_flops_per_token(cfg, context)
    weights = _weights_for(cfg, min(cfg.n_routed_experts, batch * cfg.top_k), dtype_bytes)
    return max((weights + cache) / bandwidth, flops / flops_per_s)


def tpot_cache_read_once(cfg, context, batch, bandwidth, flops_per_s, dtype_bytes=2):
    """Reads one sequence's cache for the whole batch (each sequence has its own)."""
    cache = accounting.kv_cache_bytes(cfg, context, dtype_bytes)
    flops = batch * accounting.decode_flops_per_token(cfg, context)
    return max((_weights_for(cfg, _touched(cfg, batch), dtype_bytes) + cache) / bandwidth, flops / flops_per_s)


def tpot_whole_embedding_table(cfg, context, batch, bandwidth, flops_per_s, dtype_bytes=2):
    """Reads the whole embedding table every step (a lookup reads only the batch's rows; the old convention)."""
    cache = batch * accounting.kv_cache_bytes(cfg, context, dtype_bytes)
    flops = batch * accounting.decode_flops_per_token(cfg, context)
    return max((_weights_for(cfg, _touched(cfg, batch), dtype_bytes) + cache) / bandwidth, flops / flops_per_s)


def tpot_no_embedding_at_all(cfg, context, batch, bandwidth, flops_per_s, dtype_bytes=2):
    """Leaves the embedding out entirely (no row read), also for a tied head, which reads the whole table."""
    cache = batch * accounting.kv_cache_bytes(cfg, context, dtype_bytes)
    flops = batch * accounting.decode_flops_per_token(cfg, context)
    weights = accounting.decode_weight_params(cfg.replace(tie_embeddings=False), batch) - min(batch, cfg.vocab_size) \
        * cfg.d_model
    return max((weights * dtype_bytes + cache) / bandwidth, flops / flops_per_s)



def tpot_divides_by_the_moe_layers(cfg, context, batch, bandwidth, flops_per_s, dtype_bytes=2):
    """Right for every config with an MoE layer; one expert's size is routed / (n · MoE layers), a division by
    zero when every layer is a dense FFN."""
    cache = batch * accounting.kv_cache_bytes(cfg, context, dtype_bytes)
    flops = batch * accounting.decode_flops_per_token(cfg, context)
    table, rows = cfg.vocab_size * cfg.d_model, min(batch, cfg.vocab_size) * cfg.d_model
    weights = _weights_for(cfg, _touched(cfg, batch), dtype_bytes) + (0 if cfg.tie_embeddings else (rows - table)
                                                                      * dtype_bytes)
    return max((weights + cache) / bandwidth, flops / flops_per_s)

def price_forgets_the_batch(step_s, batch, gpus, usd_per_gpu_hour):
    """Prices a step as if it made one token (it makes one per sequence of the batch)."""
    return 1e6 * gpus * usd_per_gpu_hour / 3600 * step_s


def price_of_one_gpu(step_s, batch, gpus, usd_per_gpu_hour):
    """Pays for one GPU (the whole deployment runs every step)."""
    return 1e6 * usd_per_gpu_hour / 3600 * step_s / batch


def price_per_hour_as_per_second(step_s, batch, gpus, usd_per_gpu_hour):
    """Takes the hourly price as a price per second."""
    return 1e6 * gpus * usd_per_gpu_hour * step_s / batch


def price_accepts_anything(step_s, batch, gpus, usd_per_gpu_hour):
    """The right arithmetic with no checks: a zero batch divides by zero, a negative price gives a negative cost."""
    return 1e6 * gpus * usd_per_gpu_hour / 3600 * step_s / batch


def price_lets_nan_through(step_s, batch, gpus, usd_per_gpu_hour):
    """Refuses with ``value <= 0``: NaN compares False to everything, so a NaN step or price passes."""
    for name, value in (("step_s", step_s), ("usd_per_gpu_hour", usd_per_gpu_hour)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    for name, value in (("batch", batch), ("gpus", gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return 1e6 * gpus * usd_per_gpu_hour / 3600 * step_s / batch


def price_whole_floats_and_bools_count(step_s, batch, gpus, usd_per_gpu_hour):
    """Checks the counts' values, not their types: a batch of 4.0 and True (== 1) pass as counts."""
    for name, value in (("step_s", step_s), ("usd_per_gpu_hour", usd_per_gpu_hour)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    for name, value in (("batch", batch), ("gpus", gpus)):
        if value != int(value) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    return 1e6 * gpus * usd_per_gpu_hour / 3600 * step_s / batch


WRONG = {
    "14.predicted_tpot": [tpot_flops_only, tpot_adds_bytes_and_flops, tpot_experts_of_one_token,
                          tpot_every_token_new_experts, tpot_cache_read_once, tpot_whole_embedding_table,
                          tpot_no_embedding_at_all, tpot_divides_by_the_moe_layers],
    "14.decode_usd_per_million": [price_forgets_the_batch, price_of_one_gpu, price_per_hour_as_per_second,
                                  price_accepts_anything, price_lets_nan_through,
                                  price_whole_floats_and_bools_count],
    "14.kda_step_bytes": [kda_bytes_without_conv_tails, kda_bytes_state_in_activation_dtype,
                          kda_bytes_tails_all_k_wide],
    "14.mla_step_bytes": [mla_bytes_without_rope, mla_bytes_in_numbers],
    "14.crossover_context": [crossover_ignores_the_state, crossover_state_in_activation_dtype,
                             crossover_against_all_mla_growth, crossover_rounds_up],
    "14.extrapolate_tpot": [extrapolate_through_origin, extrapolate_from_end_points],
}
