"""Independent check: K3Model runs checkpoints that transformers wrote (Kimi Linear, DeepSeek-V3 with YaRN and grouped
routing) and gets transformers' numbers (logits, a prefill + cached decode, gradients); a K3Model saved with
save_pretrained opens in transformers with the same logits; the presets count what transformers' models count.
Skips cleanly without the ``oracle`` extra (``pip install -e .[oracle]``).

transformers binds fla's Triton KDA ops when fla is installed; on a CPU the tests run its PyTorch reference paths.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from k3course import pretrained, pretrained_save
from k3course.accounting import meta_param_count
from k3course.config import K3Config
from k3course.layers.mla import GatedMLA
from k3course.lessons import kimi_linear as kimi_linear_lesson
from k3course.lessons.kimi_linear import cached_decode_logits, randomize
from k3course.model import K3Model

transformers = pytest.importorskip("transformers", minversion="5.23")
kimi_modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TOLERANCE = 1e-4  # relative to the largest |value|; fp32 agrees to ~1e-6
KDA_OPS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update")
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=2,
            num_key_value_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            num_experts_per_tok=2, pad_token_id=3, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module", autouse=True)
def torch_kda_paths():
    """On a CPU, transformers' Kimi Linear runs its PyTorch KDA and convolution (fla's kernels need a GPU)."""
    with pytest.MonkeyPatch.context() as patch:
        if not torch.cuda.is_available():
            for name in KDA_OPS:
                patch.setattr(kimi_modeling, name, inspect.unwrap(getattr(kimi_modeling, name)))
        yield


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max())


def kimi_linear_reference(tmp_path, **changes):
    config = transformers.KimiLinearConfig(**TINY | dict(
        num_hidden_layers=4, num_local_experts=8, linear_num_heads=2, linear_head_dim=8, n_group=1, topk_group=1,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]) | changes)
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(config)
    randomize(model, 1)
    model.save_pretrained(tmp_path, max_shard_size="40KB")  # sharded, with an index
    return model.eval()


def deepseek_reference(tmp_path):
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
                beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)  # cos, sin and the softmax scale all rescaled
    config = transformers.DeepseekV3Config(**TINY | dict(
        num_hidden_layers=3, q_lora_rank=16, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=64, rope_parameters=yarn))
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    randomize(model, 2)
    model.save_pretrained(tmp_path)
    return model.eval()


def tokens(seed: int, batch: int = 2, length: int = 11) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def loaded(path) -> K3Model:
    return K3Model.from_pretrained(path)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear")
    return kimi_linear_reference(path), loaded(path), path


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    return deepseek_reference(path), loaded(path), path


def test_the_saved_configs_translate_to_the_settings_transformers_runs(kimi_linear, deepseek):
    kimi = kimi_linear[1].cfg
    assert (kimi.layer_types(), kimi.norm_eps, kimi.kda_norm_eps, kimi.kda_gate_bias, kimi.mla_rope) == \
        (("kda", "mla", "kda", "mla"), 1e-5, 1e-5, False, False)
    assert kimi.pad_token_id == 3 and kimi.route_scale == 2.446
    seek = deepseek[1].cfg
    assert (seek.n_expert_groups, seek.topk_groups, seek.mla_rope, seek.rope_interleaved) == (4, 2, True, True)
    assert (seek.rope_yarn_factor, seek.rope_yarn_original_context, seek.rope_yarn_mscale_all_dim) == (4.0, 16, 0.8)
    assert seek.first_k_dense == 1 and seek.norm_eps == 1e-6 and set(seek.layer_types()) == {"mla"}


@pytest.mark.parametrize("name", ["kimi_linear", "deepseek"])
def test_logits_match_transformers(name, request):
    reference, model, _ = request.getfixturevalue(name)
    ids = tokens(3)
    with torch.no_grad():
        theirs = reference(ids).logits
        ours, _, _ = model(ids)
    assert relative_error(ours, theirs) < TOLERANCE


@pytest.mark.parametrize("name", ["kimi_linear", "deepseek"])
def test_the_sdpa_path_matches_transformers(name, request, monkeypatch):
    """Training and long prefills attend through SDPA (the naive path, ``attend_sdpa``); here forced at a short
    length: the same logits as transformers, DeepSeek's YaRN softmax scale included."""
    reference, model, _ = request.getfixturevalue(name)
    attention = [module for module in model.modules() if isinstance(module, GatedMLA)]
    assert attention and all(module.sdpa for module in attention)
    for module in attention:
        monkeypatch.setattr(module, "absorbed", False)
    ids = tokens(7)
    with torch.no_grad():
        assert relative_error(model(ids)[0], reference(ids).logits) < TOLERANCE


@pytest.mark.parametrize("name", ["kimi_linear", "deepseek"])
@pytest.mark.filterwarnings("error::FutureWarning", "error::DeprecationWarning")
def test_prefill_and_cached_decode_match_transformers(name, request, caplog):
    reference, model, _ = request.getfixturevalue(name)
    ids, prompt = tokens(4), 8
    transformers.utils.logging.enable_propagation()  # its log records reach caplog
    try:
        theirs = cached_decode_logits(reference, ids, prompt)  # a deprecated transformers call would raise here
    finally:
        transformers.utils.logging.disable_propagation()
    assert not [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]  # nor log it
    with torch.no_grad():
        cache = model.new_cache(ids.shape[0], ids.shape[1])
        ours = [model(ids[:, :prompt], cache)[0]] + [model(ids[:, t:t + 1], cache)[0]
                                                     for t in range(prompt, ids.shape[1])]
    assert relative_error(torch.cat(ours, 1), theirs) < TOLERANCE


def test_the_lessons_torch_kda_paths_run_without_a_fallback_notice(kimi_linear, caplog):
    """Lesson 15 runs transformers' PyTorch KDA on purpose: no "falling back to its reference PyTorch
    implementation" under its results (transformers logs each message once per process: the cache is cleared)."""
    transformers.utils.logging.warning_once.cache_clear()
    transformers.utils.logging.enable_propagation()
    try:
        with kimi_linear_lesson.torch_kda_paths(), torch.no_grad():
            kimi_linear[0](tokens(5))
    finally:
        transformers.utils.logging.disable_propagation()
    assert not [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]


def test_cached_decode_hands_the_cache_back_by_the_name_an_older_transformers_takes():
    """transformers 5.23's forward takes and returns the cache as ``past_key_values`` (no ``cache`` argument)."""

    class CountsTokensSeen(torch.nn.Module):
        def forward(self, ids, use_cache=False, past_key_values=None):
            seen = (past_key_values or 0) + ids.shape[1]
            return SimpleNamespace(logits=torch.full((*ids.shape, 1), float(seen)), past_key_values=seen)

    logits = cached_decode_logits(CountsTokensSeen(), torch.zeros(1, 5, dtype=torch.long), prompt=3)
    assert logits.flatten().tolist() == [3.0, 3.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="prompt"):
        cached_decode_logits(CountsTokensSeen(), torch.zeros(1, 5, dtype=torch.long), prompt=0)


@pytest.mark.parametrize("name", ["kimi_linear", "deepseek"])
def test_gradients_match_transformers(name, request):
    reference, model, _ = request.getfixturevalue(name)
    ids, targets = tokens(5), tokens(6)
    loss = lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    reference.zero_grad()
    model.zero_grad()
    loss(reference(ids).logits).backward()
    loss(model(ids)[0]).backward()
    their_grads = {n: p.grad for n, p in reference.named_parameters()}
    their_grads |= {n: torch.zeros_like(b) for n, b in reference.named_buffers() if n.endswith("correction_bias")}
    theirs = pretrained.convert_state(their_grads, model.cfg)  # transformers' fused layout, mapped by name
    ours = dict(model.named_parameters())
    assert set(theirs) - {n for n in theirs if n.endswith("ffn.bias")} == set(ours)
    names = sorted(ours)  # all gradients as one vector: a tensor of tiny gradients has no digits of its own to lose
    assert relative_error(torch.cat([ours[n].grad.flatten() for n in names]),
                          torch.cat([theirs[n].flatten() for n in names])) < TOLERANCE


def test_a_saved_k3_model_opens_in_transformers_with_the_same_logits(tmp_path):
    cfg = K3Config.preset("kimi-linear-48b").replace(
        name="tiny kimi linear", vocab_size=64, d_model=32, n_layers=4, mla_layers=(1, 3), kda_n_heads=2,
        kda_head_dim=8, mla_n_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=8, top_k=2, expert_dim=16, dense_ffn_dim=48, n_expert_groups=2, topk_groups=1, pad_token_id=0)
    torch.manual_seed(7)
    model = K3Model.from_config(cfg).eval()
    randomize(model, 8)
    for moe in model.moe_layers():
        moe.bias.normal_(0, 0.05)
    model.save_pretrained(tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / pretrained.INDEX_FILE).is_file()
    reference = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path).eval()
    ids = tokens(9)
    with torch.no_grad():
        assert relative_error(model(ids)[0], reference(ids).logits) < TOLERANCE
    again = K3Model.from_pretrained(tmp_path)
    assert again.cfg.replace(name=cfg.name, context_length=cfg.context_length) == cfg
    assert all(torch.equal(t, again.state_dict()[n]) for n, t in model.state_dict().items())


@pytest.mark.parametrize("preset", ["kimi-linear-48b", "deepseek-v3", "kimi-k2"])
def test_meta_counts_of_the_presets_equal_transformers_models(preset):
    cfg = K3Config.preset(preset)
    if preset == "kimi-linear-48b":
        config = transformers.KimiLinearConfig(**pretrained_save.kimi_linear_config(cfg))
        build = transformers.KimiLinearForCausalLM
    else:
        config = transformers.DeepseekV3Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.dense_ffn_dim,
            moe_intermediate_size=cfg.expert_dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.mla_n_heads,
            num_key_value_heads=cfg.mla_n_heads, n_shared_experts=cfg.n_shared_experts,
            n_routed_experts=cfg.n_routed_experts, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
            n_group=cfg.n_expert_groups, topk_group=cfg.topk_groups, num_experts_per_tok=cfg.top_k,
            first_k_dense_replace=cfg.first_k_dense)
        build = transformers.DeepseekV3ForCausalLM
    with torch.device("meta"):
        reference = build(config)
    assert sum(p.numel() for p in reference.parameters()) == meta_param_count(cfg)["total"]


def test_mtp_layers_are_skipped_and_stray_tensors_refused(deepseek):
    reference, model, path = deepseek
    state = {n: t for n, t in reference.state_dict().items()}
    layer = model.cfg.n_layers
    mtp = {f"model.layers.{layer}.eh_proj.weight": torch.zeros(2, 2),
           f"model.layers.{layer}.enorm.weight": torch.ones(2)}
    assert pretrained.convert_state(state | mtp, model.cfg).keys() == model.state_dict().keys()
    with pytest.raises(pretrained.UnsupportedCheckpoint, match="cannot place.*weight_scale_inv"):
        pretrained.convert_state(state | {"model.layers.0.mlp.gate_proj.weight_scale_inv": torch.ones(1)}, model.cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's KimiDeltaAttention runs Triton kernels (a GPU)")
def test_kda_layer_matches_fla_kimi_delta_attention():
    """Our KimiDeltaAttention with Kimi Linear's settings against fla's layer (kernels in-kernel gate, l2norm,
    gated RMSNorm), weights mapped: fla's f_proj / g_proj / q_conv1d ... to ours."""
    fla_kda = pytest.importorskip("fla.layers.kda")
    from k3course.layers.kda import KimiDeltaAttention

    torch.manual_seed(0)
    theirs = fla_kda.KimiDeltaAttention(hidden_size=64, head_dim=16, num_heads=4, norm_eps=1e-5).cuda()
    ours = KimiDeltaAttention(64, 4, 16, lower_bound=None, output_gate="low_rank", norm_eps=1e-5).cuda()
    with torch.no_grad():
        mapped = {f"{x}_conv.weight": getattr(theirs, f"{x}_conv1d").weight.squeeze(1) for x in "qkv"}
        mapped |= {"dt_bias": theirs.dt_bias.view(4, 16),
                  "gate_proj.0.weight": theirs.g_proj[0].weight, "gate_proj.1.weight": theirs.g_proj[1].weight,
                  "gate_proj.1.bias": theirs.g_proj[1].bias, "o_norm_weight": theirs.o_norm.weight}
        kept = ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "f_proj", "A_log")
        same = {n: p for n, p in theirs.named_parameters() if n.split(".")[0] in kept}
        ours.load_state_dict(same | mapped)
    x = torch.randn(2, 100, 64, device="cuda")
    assert relative_error(ours(x)[0], theirs(x)[0]) < 1e-3  # Triton on both sides: dots may run in TF32
