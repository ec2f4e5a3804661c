"""Checkpoints in transformers' layout without transformers: the released config.json keys give the presets, what
the course cannot express is refused by name, and a K3Model goes through save_pretrained / from_pretrained unchanged
(tests/test_oracle_transformers.py checks the same files against transformers itself)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from k3course import pretrained, pretrained_save
from k3course.config import K3Config
from k3course.model import K3Model

# The keys of the released config.json files (abridged): 1-indexed full_attn_layers, num_experts, rope_scaling.
RELEASED_KIMI_LINEAR = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
    "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_attention_heads": 32, "num_key_value_heads": 32,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "num_expert_group": 1,
    "topk_group": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "mla_use_nope": True,
    "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-5, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "model_max_length": 1048576, "tie_word_embeddings": False, "pad_token_id": 163839, "hidden_act": "silu",
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
                           "short_conv_kernel_size": 4,
                           "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]}}

RELEASED_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
    "rope_theta": 10000, "num_nextn_predict_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}


def test_released_config_keys_give_the_presets():
    cfg = pretrained.config_from_hf(RELEASED_KIMI_LINEAR, name="kimi-linear-48b")
    assert cfg.replace(mla_layers=None) == K3Config.preset("kimi-linear-48b")
    cfg = pretrained.config_from_hf(RELEASED_DEEPSEEK_V3, name="deepseek-v3")
    preset = K3Config.preset("deepseek-v3")
    assert cfg.replace(context_length=preset.context_length) == preset.replace(
        kda_n_heads=cfg.kda_n_heads, kda_head_dim=cfg.kda_head_dim, kda_norm_eps=1e-6)


def test_kimi_k2_is_read_as_deepseek_v3():
    hf = RELEASED_DEEPSEEK_V3 | {"model_type": "kimi_k2", "rope_theta": 50000.0, "n_group": 1, "topk_group": 1}
    cfg = pretrained.config_from_hf(hf)
    assert cfg.mla_rope and cfg.rope_theta == 50000.0 and cfg.n_expert_groups == 1


@pytest.mark.parametrize("change, named", [
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
     "quantization_config: expected fmt 'e4m3'"),
    (dict(quantization_config={"quant_method": "fp8"}), "weight_block_size None"),
    (dict(quantization_config={"quant_method": "awq"}), "quant_method 'awq'"),
    (dict(quantization_config={"quant_method": "compressed-tensors"}), "quantization_config.*INT4"),
    (dict(scoring_func="softmax"), "scoring_func"), (dict(topk_method="greedy"), "topk_method"),
    (dict(hidden_act="gelu"), "hidden_act"), (dict(attention_bias=True), "attention_bias"),
    (dict(rope_scaling={"type": "longrope", "factor": 2}), "rope_type"), (dict(model_type="llama"), "model_type")])
def test_what_the_course_cannot_express_is_refused_by_name(change, named):
    with pytest.raises(pretrained.UnsupportedCheckpoint, match=named):
        pretrained.config_from_hf(RELEASED_DEEPSEEK_V3 | change)


def tiny_kimi_linear(**changes) -> K3Config:
    return K3Config.preset("kimi-linear-48b").replace(
        name="tiny kimi linear", vocab_size=64, d_model=32, n_layers=4, mla_layers=(1, 3), kda_n_heads=2,
        kda_head_dim=8, mla_n_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=8, top_k=2, expert_dim=16, dense_ffn_dim=48, pad_token_id=0, **changes)


@pytest.mark.parametrize("changes", [dict(), dict(q_lora_rank=16, tie_embeddings=True, n_expert_groups=2)])
def test_save_pretrained_then_from_pretrained_gives_the_same_model(tmp_path, changes):
    cfg = tiny_kimi_linear(**changes)
    torch.manual_seed(0)
    model = K3Model.from_config(cfg).eval()
    for moe in model.moe_layers():
        moe.bias.normal_(0, 0.05)
    model.save_pretrained(tmp_path, max_shard_bytes=30_000)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "kimi_linear" and saved["layer_types"][1] == "full_attention"
    assert (tmp_path / pretrained.INDEX_FILE).is_file()  # sharded at layer boundaries
    loaded = K3Model.from_pretrained(tmp_path)
    assert loaded.cfg.replace(name=cfg.name) == cfg and not loaded.training
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(t, loaded.state_dict()[n]) for n, t in model.state_dict().items())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids)[0], model(ids)[0])


def test_a_loaded_model_trains_with_its_marks_and_an_fp32_bias(tmp_path):
    model = K3Model.from_config(tiny_kimi_linear())
    model.save_pretrained(tmp_path)
    loaded = K3Model.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert [len(g["params"]) for g in loaded.param_groups(0.1)] == [len(g["params"]) for g in model.param_groups(0.1)]
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert all(moe.bias.dtype == torch.float32 for moe in loaded.moe_layers())
    loaded.train()
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    _, loss, _ = loaded(ids, targets=ids)
    loss.backward()
    assert torch.isfinite(loss) and all(moe.update_bias() for moe in loaded.moe_layers())
    assert (loaded.embed.weight.grad[0] == 0).all()  # the padding row (pad_token_id = 0) gets no gradient


def test_save_pretrained_names_what_kimi_linear_cannot_express(tmp_path):
    model = K3Model.from_config(K3Config.preset("tiny"), device="meta")
    with pytest.raises(pretrained.UnsupportedCheckpoint, match="residual='block_attnres'.*ffn_activation='situ_glu'"):
        model.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())
    with pytest.raises(pretrained.UnsupportedCheckpoint, match="kda_norm_eps"):
        pretrained_save.kimi_linear_config(tiny_kimi_linear(kda_norm_eps=1e-6))


def test_missing_files_and_tensors_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        K3Model.from_pretrained(tmp_path)
    model = K3Model.from_config(tiny_kimi_linear())
    model.save_pretrained(tmp_path)
    state = {name: t for name, t in safetensors.torch.load_file(tmp_path / "model.safetensors").items()
             if not name.startswith("model.layers.")}
    missing = "tensor model.layers.0.input_layernorm.weight is missing"
    with pytest.raises(pretrained.UnsupportedCheckpoint, match=missing):
        pretrained.convert_state(state, model.cfg)
