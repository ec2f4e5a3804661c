"""The released K3: its preset's count and ε, its checkpoint layout read and written (bf16 and MXFP4 routed experts),
without a download: a tiny K3-layout folder made by the package's own code round-trips, generates from the command
line, and every piece the course cannot express is refused by name."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from k3course import accounting, layout
from k3course.cli import main
from k3course.config import K3Config
from k3course.lessons.kimi_linear import TINY_K3, beside_the_release, tiny_k3, with_mxfp4_experts
from k3course.model import K3Model
from k3course.pretrained import PretrainedFolder, UnsupportedCheckpoint

TOKENS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])


# --- the preset --------------------------------------------------------------------------------------------------

def test_the_k3_count_is_the_model_cards():
    count = accounting.param_count(K3Config.preset("kimi-k3"))
    without_embedding = count.active - count.components["embedding"][1]
    assert abs(without_embedding / 1e9 - 104.2) <= 0.1
    assert round(count.total / 1e12, 2) == 2.78  # tests/test_model.py: the model holds exactly this count


def norm_epsilons(model: nn.Module) -> dict[str, float]:
    """Every ε a module of the model holds: nn.RMSNorm's eps, and the eps / norm_eps of the package's layers."""
    found = {}
    for name, module in model.named_modules():
        for attribute in ("eps", "norm_eps"):
            if isinstance(getattr(module, attribute, None), float):
                found[f"{name}.{attribute}"] = getattr(module, attribute)
    return found


@pytest.mark.parametrize("preset", ["tiny", "kimi-k3"])
def test_every_norms_eps_comes_from_the_config(preset):
    cfg = K3Config.preset(preset).replace(norm_eps=3e-5, kda_norm_eps=3e-5, n_layers=4, mla_layers=None)
    model = K3Model.from_config(cfg, device="meta")
    found = norm_epsilons(model)
    kinds = {name.rsplit(".", 2)[-2] if "." in name else name for name in found}
    assert {"q_norm", "kv_norm", "mixer", "ffn", "residual", "final_norm"} <= kinds, kinds
    assert set(found.values()) == {3e-5}, {k: v for k, v in found.items() if v != 3e-5}


def test_the_k3_preset_is_the_release_where_it_is_known():
    k3 = K3Config.preset("kimi-k3")
    assert (k3.norm_eps, k3.kda_norm_eps, k3.dense_ffn_dim, k3.attnres_key_weight) == (1e-5, 1e-5, 33792, True)
    tiny = K3Config.preset("tiny")  # the course's presets keep what they were trained with
    assert (tiny.norm_eps, tiny.kda_norm_eps, tiny.attnres_key_weight) == (1e-6, 1e-6, False)


def test_the_attnres_key_norm_is_a_norm_weight_and_folds_into_the_query():
    cfg = TINY_K3
    model = K3Model.from_config(cfg)
    key_norms = model.residual.key_norms
    groups = model.param_groups(weight_decay=0.1)
    assert any(key_norms is p for g in groups if g["weight_decay"] == 0 for p in g["params"])
    torch.manual_seed(0)
    with torch.no_grad():
        model.residual.queries.normal_()
        key_norms.uniform_(0.5, 1.5)
    logits = model.eval()(TOKENS)[0]
    folded = K3Model.from_config(cfg.replace(attnres_key_weight=False)).eval()
    state = {k: v for k, v in model.state_dict().items() if k != "residual.key_norms"}
    state["residual.queries"] = model.residual.queries * key_norms
    folded.load_state_dict(state)
    torch.testing.assert_close(folded(TOKENS)[0], logits, rtol=1e-5, atol=1e-5)


# --- MXFP4 -------------------------------------------------------------------------------------------------------

def test_mxfp4_codes_on_hand_made_values():
    magnitudes = torch.tensor(layout.E2M1_MAGNITUDES)
    assert magnitudes.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    # codes 0..15 in one row of 32: the low nibble holds the even-indexed weight
    codes = torch.arange(32) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)[None]
    scale = torch.tensor([[127]], dtype=torch.uint8)  # 2^0
    values = layout.unpack_mxfp4(packed, scale)[0]
    expected = torch.cat([magnitudes, -magnitudes]).repeat(2)
    assert torch.equal(values, expected)
    assert values[8].item() == 0 and str(values[8].item()) == "-0.0"  # code 8 is −0
    # byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0) second
    one = torch.zeros(1, 16, dtype=torch.uint8)
    one[0, 0] = 0x21
    assert layout.unpack_mxfp4(one, torch.tensor([[127]], dtype=torch.uint8))[0, :2].tolist() == [0.5, 1.0]
    # the scale's exponent bias: byte 130 is 2^3, byte 120 is 2^-7
    assert layout.unpack_mxfp4(one, torch.tensor([[130]], dtype=torch.uint8))[0, :2].tolist() == [4.0, 8.0]
    assert layout.unpack_mxfp4(one, torch.tensor([[120]], dtype=torch.uint8))[0, 0].item() == 0.5 * 2**-7


def test_mxfp4_packs_what_it_can_represent_exactly_and_rounds_the_rest():
    row = torch.tensor([6.0, -4.0, 3.0, 0.5, -0.0, 1.5, 2.0, -1.0] * 4) * 2.0**-5
    packed, scale = layout.pack_mxfp4(row[None])
    assert packed.shape == (1, 16) and scale.tolist() == [[127 - 5]]  # e = ⌊log₂ 6·2⁻⁵⌋ − 2 = −3 − 2
    assert packed[0, 0].item() == (0xE << 4) | 0x7  # 6 (code 7) in the low nibble, −4 (sign 8 | code 6) high
    assert torch.equal(layout.unpack_mxfp4(packed, scale)[0], row)
    weights = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    back = layout.unpack_mxfp4(*layout.pack_mxfp4(weights))
    group_max = weights.abs().reshape(64, 3, 32).amax(-1).repeat_interleave(32, -1)
    assert ((back - weights).abs() <= group_max / 4 + 1e-7).all()  # half the widest e2m1 step, 2 · 2^e ≤ max/2
    assert torch.equal(layout.unpack_mxfp4(*layout.pack_mxfp4(back)), back)


def test_bad_mxfp4_is_named():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(layout.LayoutError, match="w1: .*weight_scale of shape \\(2, 1\\)"):
        layout.unpack_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8), name="w1")
    with pytest.raises(layout.LayoutError, match="255"):
        layout.unpack_mxfp4(packed, torch.full((2, 1), 255, dtype=torch.uint8))
    with pytest.raises(layout.LayoutError, match="multiple of 32"):
        layout.pack_mxfp4(torch.ones(2, 48))


# --- the layout, read and written ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tiny_k3(tmp_path_factory.mktemp("k3_bf16"))


@pytest.fixture(scope="module")
def saved_mxfp4(tmp_path_factory):
    return tiny_k3(tmp_path_factory.mktemp("k3_mxfp4"), mxfp4=True)


def test_a_bf16_k3_folder_round_trips_exactly(saved):
    model, path = saved
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["rms_norm_eps"] == 1e-5
    names = safetensors.torch.load_file(path / "model.safetensors")
    assert "language_model.model.layers.3.self_attn.g_proj.weight" in names
    assert names["language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight"].dtype == torch.bfloat16
    loaded = K3Model.from_pretrained(path)
    assert loaded.cfg == TINY_K3.replace(name=loaded.cfg.name)
    assert torch.equal(loaded(TOKENS)[0], model(TOKENS)[0])


def test_an_mxfp4_k3_folder_is_its_dequantized_model(saved_mxfp4):
    model, path = saved_mxfp4
    names = safetensors.torch.load_file(path / "model.safetensors")
    packed = names["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    scale = names["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"]
    f, latent = TINY_K3.expert_dim, TINY_K3.latent_dim
    assert (packed.dtype, tuple(packed.shape), tuple(scale.shape)) == (torch.uint8, (f, latent // 2), (f, latent // 32))
    assert not any(name.endswith("shared_experts.gate_proj.weight_packed") for name in names)
    loaded = K3Model.from_pretrained(path)
    reference = model(TOKENS)[0]
    logits = loaded(TOKENS)[0]
    dequantized = with_mxfp4_experts(copy.deepcopy(model))
    assert torch.equal(logits, dequantized(TOKENS)[0])
    assert not torch.equal(logits, reference)
    for i in range(TINY_K3.first_k_dense, TINY_K3.n_layers):  # within MXFP4's rounding: ~11% of a weight's RMS
        for name in ("gate_up", "down"):
            ours, theirs = getattr(model.layers[i].ffn.experts, name), getattr(loaded.layers[i].ffn.experts, name)
            assert 0.05 < float((theirs - ours).detach().norm() / ours.detach().norm()) < 0.15


def test_the_text_only_spelling_and_a_vision_tower_are_read(saved, tmp_path, capsys):
    model, path = saved
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    tensors = {name.removeprefix("language_model."): t for name, t in tensors.items()}
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(2, 2)
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(path / "config.json", tmp_path)
    loaded = K3Model.from_pretrained(tmp_path)
    assert capsys.readouterr().out.count("skipping the vision tower's 1 tensors") == 1
    assert torch.equal(loaded(TOKENS)[0], model(TOKENS)[0])


def test_generate_runs_on_the_k3_folder(saved_mxfp4, capsys):
    assert main(["generate", "--pretrained", str(saved_mxfp4[1]), "--prompt", "K3", "--max-new-tokens", "6",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("K3")


def copy_with(path, tmp_path, change):
    """A copy of the folder with its config.json changed by ``change(config)``."""
    for item in path.iterdir():
        shutil.copy(item, tmp_path)
    config = json.loads((path / "config.json").read_text())
    change(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


REFUSED = [
    (lambda c: c["text_config"].update(hidden_act="gelu"), "hidden_act: 'gelu'"),
    (lambda c: c["text_config"].update(activation_situ_beta=2.0), "activation_situ_beta: 2.0"),
    (lambda c: c["text_config"].update(latent_moe_use_norm=False), "latent_moe_use_norm: False"),
    (lambda c: c["text_config"].update(mla_use_nope=False), "mla_use_nope: False"),
    (lambda c: c["text_config"]["linear_attn_config"].update(use_full_rank_gate=False), "use_full_rank_gate"),
    (lambda c: c["text_config"].pop("attn_res_block_size"), "attn_res_block_size"),
    (lambda c: c.pop("text_config"), "text_config"),
    (lambda c: c.update(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"}),
     "format 'pack-quantized'"),
    (lambda c: c.update(quantization_config={"format": "mxfp4-pack-quantized",
                                             "config_groups": {"g": {"weights": {"group_size": 16}}}}),
     "group_size"),
    (lambda c: c["text_config"].update(intermediate_size=64), "layers.0.ffn.gate: the checkpoint holds shape"),
]


@pytest.mark.parametrize(("change", "named"), REFUSED, ids=[named for _, named in REFUSED])
def test_what_the_course_cannot_express_is_refused_by_name(saved, tmp_path, capsys, change, named):
    folder = copy_with(saved[1], tmp_path, change)
    with pytest.raises(ValueError, match=named):
        K3Model.from_pretrained(folder)
    assert main(["generate", "--pretrained", str(folder), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and named.split(":")[0] in error


def test_save_names_what_the_k3_layout_cannot_express(tmp_path):
    model = K3Model.from_config(K3Config.preset("tiny"))  # as trained: parameter-free AttnRes keys
    with pytest.raises(UnsupportedCheckpoint, match="attnres_key_weight=False"):
        model.save_pretrained(tmp_path, layout="kimi_k3")
    with pytest.raises(ValueError, match="layout must be one of"):
        model.save_pretrained(tmp_path, layout="gguf")


def test_the_folders_config_beside_the_released_one(saved):
    rows = {key: (ours, released) for key, ours, released in beside_the_release(saved[1])}
    assert rows["rms_norm_eps"] == (1e-5, 1e-5) and rows["intermediate_size"] == (256, 33792)
    assert rows["linear_attn_config.full_attn_layers"][1][-2:] == [92, 93]
    assert PretrainedFolder(saved[1]).config.layer_types() == TINY_K3.layer_types()


def test_the_shipped_tiny_checkpoint_loads_as_it_was_trained():
    """Saved before attnres_key_weight existed: it takes its default (no key-norm weights), and ε stays 1e-6."""
    folder = Path(__file__).resolve().parents[1] / "k3course" / "checkpoints" / "tiny"
    saved_cfg = K3Config.from_dict(json.loads((folder / "config.json").read_text())["model"])
    assert (saved_cfg.attnres_key_weight, saved_cfg.norm_eps, saved_cfg.kda_norm_eps) == (False, 1e-6, 1e-6)
    assert saved_cfg == K3Config.preset("tiny")
