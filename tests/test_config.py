"""K3Config: presets count to the published sizes, the two counts agree, the accounting is right, bad input is named;
fields from TOML and key=value text."""

from __future__ import annotations

import dataclasses
import re

import pytest

from k3course import accounting, config
from k3course.accounting import kda_layer_params, meta_layer, meta_param_count, mla_layer_params, moe_layer_params
from k3course.config import PRESETS, PUBLISHED_PARAMS, K3Config


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "kimi-k3"])
def test_reference_presets_count_to_published_total_and_active_within_3_percent(name):
    count = accounting.param_count(K3Config.preset(name))
    total, active = PUBLISHED_PARAMS[name]
    assert count.total == pytest.approx(total, rel=0.03)
    assert count.active == pytest.approx(active, rel=0.03)


def test_kimi_linear_counts_to_48b_and_its_active_count_is_3b_without_the_embedding_lookup():
    count = accounting.param_count(K3Config.preset("kimi-linear-48b"))
    assert count.total == pytest.approx(48e9, rel=0.03)
    # "A3B" rounds down: 3.48B counting every touched weight, 3.11B without the input embedding table.
    assert count.active == pytest.approx(3.48e9, rel=0.01)
    assert count.active - count.components["embedding"][1] == pytest.approx(3e9, rel=0.05)


@pytest.mark.parametrize("name", PRESETS)
def test_meta_device_count_of_the_real_model_equals_the_analytic_count(name):
    cfg = K3Config.preset(name)
    counts, meta = accounting.param_count(cfg), meta_param_count(cfg)
    assert meta["total"] == counts.total and meta["active"] == counts.active
    for component, total_and_active in counts.components.items():
        assert meta[component] == total_and_active, component


@pytest.mark.parametrize("changes", [dict(kda_output_gate="low_rank"), dict(q_lora_rank=None, mla_gated=False),
                                     dict(kda_output_gate="low_rank", kda_gate_bias=False),
                                     dict(latent_dim=None, n_shared_experts=0), dict(tie_embeddings=True),
                                     dict(residual="prenorm"), dict(top_k=8), dict(first_k_dense=4)])
def test_meta_count_equals_the_analytic_count_for_every_option(changes):
    cfg = K3Config.preset("tiny").replace(**changes)
    meta = meta_param_count(cfg)
    assert (meta["total"], meta["active"]) == (accounting.param_count(cfg).total, accounting.param_count(cfg).active)


def test_meta_layers_allocate_nothing_and_match_the_per_layer_formulas():
    cfg = K3Config.preset("kimi-k3")
    kda, mla, moe = meta_layer(cfg, "kda"), meta_layer(cfg, "mla"), meta_layer(cfg, "moe")
    assert all(p.is_meta for module in (kda, mla, moe) for p in module.parameters())
    assert sum(p.numel() for p in kda.parameters()) == kda_layer_params(cfg)
    assert sum(p.numel() for p in mla.parameters()) == mla_layer_params(cfg)
    assert sum(p.numel() for p in moe.parameters()) == moe_layer_params(cfg)[0]


def test_k3_per_layer_numbers_by_hand():
    cfg = K3Config.preset("kimi-k3")
    expert = 3 * 3584 * 3072  # gate, up, down in the 3584-wide latent space
    always_on = 3 * 7168 * 6144 + 2 * 7168 * 3584 + 3584 + 896 * 7168
    assert moe_layer_params(cfg) == (896 * expert + always_on, 16 * expert + always_on)
    mla = 7168 * 1536 + 1536 + 1536 * 96 * 192 + 7168 * 576 + 512 + 512 * 96 * 256 + 2 * 7168 * 96 * 128
    assert mla_layer_params(cfg) == mla


def test_schedules_match_the_papers():
    k3 = K3Config.preset("kimi-k3")
    assert (k3.n_kda_layers, k3.n_mla_layers) == (69, 24) and k3.layer_types()[-1] == "mla"
    assert k3.layer_types()[:4] == ("kda", "kda", "kda", "mla") and k3.ffn_types()[:2] == ("dense", "moe")
    linear = K3Config.preset("kimi-linear-48b")
    assert [i + 1 for i, kind in enumerate(linear.layer_types()) if kind == "mla"] == [4, 8, 12, 16, 20, 24, 27]
    assert set(K3Config.preset("kimi-k2").layer_types()) == {"mla"}
    tiny = K3Config.preset("tiny")
    assert tiny.layer_types() == ("kda", "kda", "kda", "mla") and tiny == K3Config()
    assert K3Config(mla_layers=()).layer_types() == ("kda",) * 4


def test_activation_ratios():
    assert accounting.activation_ratio(K3Config.preset("kimi-k3")) == pytest.approx(16 / 896)
    assert accounting.activation_ratio(K3Config.preset("kimi-k2")) == pytest.approx(8 / 384)
    assert accounting.activation_ratio(K3Config(n_routed_experts=4, top_k=4)) == 1.0


def test_active_counts_only_the_chosen_routed_experts():
    cfg = K3Config.preset("small")
    dense_routing = accounting.param_count(cfg.replace(top_k=cfg.n_routed_experts))
    assert dense_routing.active == dense_routing.total
    count = accounting.param_count(cfg)
    inactive = count.total - count.active
    assert inactive == count.components["routed_experts"][0] - count.components["routed_experts"][1] > 0


def test_kv_cache_hybrid_grows_with_mla_layers_only_and_keeps_a_constant_state():
    k3 = K3Config.preset("kimi-k3")
    assert accounting.kv_cache_bytes_per_token(k3) == 24 * 576 * 2
    assert accounting.kv_cache_bytes_per_token(k3.all_mla()) == 93 * 576 * 2
    assert accounting.recurrent_state_bytes(k3.all_mla()) == 0
    state = 69 * (96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 2)  # fp32 state, bf16 conv tails
    assert accounting.recurrent_state_bytes(k3) == state
    assert accounting.kv_cache_bytes(k3, 0) == state
    growth = accounting.kv_cache_bytes(k3, 1000) - accounting.kv_cache_bytes(k3, 999)
    assert growth == accounting.kv_cache_bytes_per_token(k3)
    saving = 1 - accounting.kv_cache_bytes(k3, 2**20) / accounting.kv_cache_bytes(k3.all_mla(), 2**20)
    assert 0.7 < saving < 0.75  # "up to 75% less KV cache"
    assert accounting.kv_cache_bytes_per_token(k3, dtype_bytes=4) == 2 * accounting.kv_cache_bytes_per_token(k3)


def test_parameter_count_scales_as_the_formula_says():
    base = K3Config()
    wider = base.replace(n_routed_experts=16)
    routed = accounting.param_count(base).components["routed_experts"][0]
    assert accounting.param_count(wider).components["routed_experts"][0] == 2 * routed
    tied = accounting.param_count(base.replace(tie_embeddings=True))
    assert tied.components["lm_head"] == (0, 0)
    full_width = accounting.param_count(base.replace(latent_dim=None)).components
    assert full_width["latent_projections"] == (0, 0)
    assert full_width["routed_experts"][0] == 2 * routed  # experts read d = 128 instead of ℓ = 64


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="name: unknown preset 'kimi-k4'.*kimi-k3.*tiny.*small"):
        K3Config.preset("kimi-k4")
    with pytest.raises(TypeError, match="name must be"):
        K3Config.preset(3)


@pytest.mark.parametrize("changes, field", [
    (dict(d_model=0), "d_model"), (dict(n_layers=2.5), "n_layers"), (dict(top_k=9), "top_k"),
    (dict(first_k_dense=5), "first_k_dense"), (dict(latent_dim=0), "latent_dim"),
    (dict(router_score="relu"), "router_score"), (dict(balancing="magic"), "balancing"),
    (dict(ffn_activation="gelu"), "ffn_activation"), (dict(residual="postnorm"), "residual"),
    (dict(mla_layers=(4,)), "mla_layers"), (dict(mla_layers=[3]), "mla_layers"),
    (dict(mla_layers=(3, 1)), "mla_layers"),
    (dict(route_scale=0.0), "route_scale"), (dict(mla_gated=1), "mla_gated"), (dict(kda_per_mla=-1), "kda_per_mla"),
    (dict(kda_output_gate="none"), "kda_output_gate"), (dict(q_lora_rank=-3), "q_lora_rank"),
    (dict(norm_eps=0.0), "norm_eps"), (dict(kda_norm_eps=-1e-6), "kda_norm_eps"), (dict(mla_rope=1), "mla_rope"),
    (dict(rope_theta=0), "rope_theta"), (dict(rope_yarn_factor=-2.0), "rope_yarn_factor"),
    (dict(rope_yarn_mscale=-1.0), "rope_yarn_mscale"), (dict(mla_rope=True, qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(n_expert_groups=3), "n_expert_groups"), (dict(topk_groups=2), "topk_groups"),
    (dict(n_expert_groups=4, topk_groups=1, top_k=3), "top_k"), (dict(pad_token_id=256), "pad_token_id"),
    (dict(renormalize_top_k=None), "renormalize_top_k"), (dict(kda_gate_bias="no"), "kda_gate_bias"),
])
def test_bad_fields_are_named(changes, field):
    with pytest.raises((ValueError, TypeError), match=field):
        K3Config(**changes)


def test_bad_arguments_are_named():
    cfg = K3Config()
    with pytest.raises(ValueError, match="context"):
        accounting.kv_cache_bytes(cfg, -1)
    with pytest.raises(ValueError, match="dtype_bytes"):
        accounting.kv_cache_bytes_per_token(cfg, dtype_bytes=0)
    with pytest.raises(ValueError, match="dtype_bytes"):
        accounting.recurrent_state_bytes(cfg, dtype_bytes=1.5)
    with pytest.raises(ValueError, match="kind"):
        meta_layer(cfg, "conv")
    for public in (kda_layer_params, mla_layer_params, moe_layer_params, meta_param_count):
        with pytest.raises(TypeError, match="cfg must be a K3Config"):
            public("tiny")
    with pytest.raises(TypeError, match="cfg"):
        meta_layer("tiny", "kda")
    with pytest.raises(TypeError, match="changes: widht"):
        cfg.replace(widht=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3


def test_decode_flops_grow_with_context_through_mla_layers_only():
    k3 = K3Config.preset("kimi-k3")
    count = accounting.param_count(k3)
    kda_state = 69 * 7 * 96 * 128 * 128
    assert accounting.decode_flops_per_token(k3, 0) == 2 * (count.active - count.components["embedding"][0]) + kda_state
    per_token = accounting.decode_flops_per_token(k3, 1001) - accounting.decode_flops_per_token(k3, 1000)
    assert per_token == 24 * 2 * 96 * (2 * 512 + 64)
    all_kda = k3.replace(mla_layers=())
    assert accounting.decode_flops_per_token(all_kda, 10**6) == accounting.decode_flops_per_token(all_kda, 0)
    at_1m = accounting.decode_flops_per_token(k3.all_mla(), 2**20) / accounting.decode_flops_per_token(k3, 2**20)
    assert 3 < at_1m < 4  # the MLA attention term dominates at 1M tokens: 93 vs 24 MLA layers
    with pytest.raises(ValueError, match="context"):
        accounting.decode_flops_per_token(k3, 1.5)


# --- settings from text (k3course train --config / --set) ----------------------------------------------------

@pytest.mark.parametrize("field, text, value", [
    ("d_model", "64", 64), ("d_model", "1_024", 1024), ("route_scale", "2", 2.0), ("mla_gated", "False", False),
    ("mla_gated", "true", True), ("name", "123", "123"), ("name", '"tiny v2"', "tiny v2"),
    ("mla_layers", "[0, 3]", (0, 3)), ("mla_layers", "none", None), ("latent_dim", "None", None),
    ("kda_lower_bound", "-3", -3.0),
])
def test_values_from_text_take_the_fields_types(field, text, value):
    got = config.value_from_text(config.field_types(K3Config)[field], text, f"model.{field}")
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("field, text, expected", [
    ("d_model", "abc", "model.d_model expects an int, got 'abc'"), ("d_model", "1.5", "expects an int, got 1.5"),
    ("mla_gated", "2", "expects a bool (true or false)"), ("mla_layers", "[0, 'a']", 'a list of ints or "none"'),
    ("route_scale", "none", "expects a number, got 'none'"),
])
def test_values_of_the_wrong_type_name_the_field_and_the_type(field, text, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        config.value_from_text(config.field_types(K3Config)[field], text, f"model.{field}")


def test_settings_are_validated_and_written_back_as_toml():
    small = K3Config.preset("small")
    with pytest.raises(ValueError, match=re.escape("run.toml: model.top_k must be ≤ n_routed_experts (16), got 17")):
        config.with_settings(small, {"top_k": 17}, "model", "run.toml")
    with pytest.raises(ValueError, match="has no field 'd_modle'; did you mean d_model"):
        config.with_settings(small, {"d_modle": 1}, "model", "run.toml")
    changed = small.replace(mla_layers=(1, 7), latent_dim=None, kda_lower_bound=None, route_scale=2.5)
    document = config.toml_document(config.toml_text({"model": changed}))
    assert config.with_settings(K3Config(), document["model"], "model", "back") == changed
    with pytest.raises(ValueError, match="not valid TOML"):
        config.toml_document("[model\n")


def test_a_config_saved_before_fields_were_added_loads_with_their_defaults():
    """Saved runs store dataclasses.asdict(config); fields added later take the defaults, which are K3's choices
    and reproduce the course's behaviour (ε 1e-6, NoPE, no expert groups, a biased low-rank gate)."""
    saved = dataclasses.asdict(K3Config.preset("small"))
    for added in ("norm_eps", "kda_norm_eps", "kda_gate_bias", "mla_rope", "n_expert_groups", "pad_token_id"):
        del saved[added]
    saved["mla_layers"] = None
    assert K3Config.from_dict(saved) == K3Config.preset("small")
    assert K3Config.from_dict({"mla_layers": [1, 3], "n_layers": 4}).mla_layers == (1, 3)
    with pytest.raises(TypeError, match="fields: widht are not K3Config fields"):
        K3Config.from_dict({"widht": 3})


def test_reference_presets_carry_their_released_settings():
    linear, seek, k2 = (K3Config.preset(name) for name in ("kimi-linear-48b", "deepseek-v3", "kimi-k2"))
    assert (linear.norm_eps, linear.kda_norm_eps, linear.kda_gate_bias, linear.mla_rope) == (1e-5, 1e-5, False, False)
    assert (seek.n_expert_groups, seek.topk_groups, seek.rope_yarn_factor, seek.rope_interleaved) == (8, 4, 40.0, True)
    assert k2.mla_rope and k2.n_expert_groups == 1 and k2.rope_theta == 50000.0
    k3 = K3Config.preset("kimi-k3")
    assert (k3.norm_eps, k3.kda_norm_eps, k3.mla_rope, k3.n_expert_groups, k3.renormalize_top_k) == (1e-5, 1e-5, False,
                                                                                                    1, True)


def test_the_number_guard_takes_ints_or_the_given_kind_and_never_a_bool():
    from k3course.guards import is_number

    assert is_number(3) and is_number(0) and not is_number(3.0) and not is_number("3") and not is_number(None)
    assert is_number(2.5, int | float) and is_number(2, int | float)
    assert not any(is_number(flag, kind) for flag in (True, False) for kind in (int, int | float))
    with pytest.raises(TypeError, match="n_layers must be an int, got True"):
        K3Config.preset("tiny").replace(n_layers=True)
