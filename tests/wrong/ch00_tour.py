"""Plausible wrong answers for chapter 00: each is a mistake a learner could make counting from a config."""

from k3course.config import K3Config


def _expert_input(cfg: K3Config) -> int:
    return cfg.d_model if cfg.latent_dim is None else cfg.latent_dim


def _always_on(cfg: K3Config, latent_norm: bool = True) -> int:
    shared = 3 * cfg.d_model * cfg.n_shared_experts * cfg.expert_dim
    latent = 0 if cfg.latent_dim is None else 2 * cfg.d_model * cfg.latent_dim + latent_norm * cfg.latent_dim
    return shared + latent + cfg.n_routed_experts * cfg.d_model


def moe_shared_not_active(cfg):
    one = 3 * _expert_input(cfg) * cfg.expert_dim
    shared = 3 * cfg.d_model * cfg.n_shared_experts * cfg.expert_dim
    return cfg.n_routed_experts * one + _always_on(cfg), cfg.top_k * one + _always_on(cfg) - shared


def moe_experts_read_full_width(cfg):
    one = 3 * cfg.d_model * cfg.expert_dim  # ignores the latent projection
    return cfg.n_routed_experts * one + _always_on(cfg), cfg.top_k * one + _always_on(cfg)


def moe_two_matrices_per_expert(cfg):
    one = 2 * _expert_input(cfg) * cfg.expert_dim  # forgets the gate of the gated MLP
    return cfg.n_routed_experts * one + _always_on(cfg), cfg.top_k * one + _always_on(cfg)


def moe_forgets_latent_norm(cfg):
    one = 3 * _expert_input(cfg) * cfg.expert_dim
    on = _always_on(cfg, latent_norm=False)
    return cfg.n_routed_experts * one + on, cfg.top_k * one + on


def ratio_counts_shared_experts(cfg):
    return (cfg.top_k + cfg.n_shared_experts) / (cfg.n_routed_experts + cfg.n_shared_experts)


def ratio_as_percent(cfg):
    return 100 * cfg.top_k / cfg.n_routed_experts


def kv_caches_decompressed_heads(cfg, dtype_bytes=2):
    per_layer = cfg.mla_n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return cfg.n_mla_layers * per_layer * dtype_bytes


def kv_forgets_rope_key(cfg, dtype_bytes=2):
    return cfg.n_mla_layers * cfg.kv_lora_rank * dtype_bytes


def kv_counts_every_layer(cfg, dtype_bytes=2):
    return cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes


WRONG = {
    "00.moe_layer_params": [moe_shared_not_active, moe_experts_read_full_width, moe_two_matrices_per_expert,
                            moe_forgets_latent_norm],
    "00.activation_ratio": [ratio_counts_shared_experts, ratio_as_percent],
    "00.kv_cache_bytes_per_token": [kv_caches_decompressed_heads, kv_forgets_rope_key, kv_counts_every_layer],
}
