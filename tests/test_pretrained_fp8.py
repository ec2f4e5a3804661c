"""Released checkpoints against transformers: a tiny DeepSeek-V3 quantized the way DeepSeek-V3 and Kimi K2 ship
(e4m3 weights, one fp32 ``weight_scale_inv`` per 128 × 128 block, ``quantization_config``) loads within FP8
rounding of its bf16 source and exactly as transformers runs the dequantized weights, through the API and
`k3course generate --pretrained`; ``n_shared_experts: 0`` loads; a tied K3Model saved opens in transformers with
its head; a Kimi K2 folder (``model_type: kimi_k2``) generates with its own tokenizer. Needs the ``oracle`` extra.

transformers 5.2x does not read the FP8 folder on a CPU (its FineGrainedFP8 quantizer requires accelerate and
runs GPU kernels), so it runs the test's own dequantization of the same files, saved as fp32.
"""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch
import torch
from test_pretrained import tiny_kimi_linear

from k3course import pretrained
from k3course.cli import main
from k3course.lessons.kimi_linear import TINY, char_tokenizer, randomize, relative_error
from k3course.model import K3Model

transformers = pytest.importorskip("transformers", minversion="5.23")

BLOCK = 128
FP8_CONFIG = dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", weight_block_size=[BLOCK, BLOCK])
E4M3_MAX = 448.0
# hidden 160 and q rank 136: weights of 1 × 2 and 2 × 2 blocks, the last ones partial
SIZES = TINY | dict(hidden_size=160, intermediate_size=144, num_hidden_layers=3, q_lora_rank=136, n_routed_experts=4,
                    n_group=1, topk_group=1, first_k_dense_replace=1)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(seed))


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The released choice: every linear weight but the router's; not the embedding, head or norms."""
    return tensor.dim() == 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): q = e4m3(W / s) with s = max |W| / 448 over each 128 × 128 block (zero-padded to whole blocks)."""
    rows, columns = (-(-size // BLOCK) for size in weight.shape)
    padded = torch.zeros(rows * BLOCK, columns * BLOCK)
    padded[:weight.shape[0], :weight.shape[1]] = weight.float()
    blocks = padded.view(rows, BLOCK, columns, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:weight.shape[0], :weight.shape[1]]
    return q.to(torch.float8_e4m3fn), scale


def fake_quantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q · s block by block, in fp32: what the FP8 weights stand for."""
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return q.float() * full[:q.shape[0], :q.shape[1]]


def write_folder(path, tensors: dict, config: dict) -> None:
    path.mkdir()
    safetensors.torch.save_file(tensors, path / pretrained.SINGLE_FILE, metadata={"format": "pt"})
    (path / pretrained.CONFIG_FILE).write_text(json.dumps(config))
    char_tokenizer().save_pretrained(path)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """Folders bf16 (the source), fp8 (quantized the released way) and dequantized (fp32, for transformers)."""
    root = tmp_path_factory.mktemp("release")
    torch.manual_seed(0)
    source = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SIZES))
    randomize(source, 1)
    source.to(torch.bfloat16).save_pretrained(root / "bf16")
    char_tokenizer().save_pretrained(root / "bf16")
    state = safetensors.torch.load_file(root / "bf16" / pretrained.SINGLE_FILE)
    config = json.loads((root / "bf16" / pretrained.CONFIG_FILE).read_text())
    fp8, dequantized = {}, {}
    for name, tensor in state.items():
        if is_quantized(name, tensor):
            fp8[name], fp8[name + "_scale_inv"] = quantize(tensor)
            dequantized[name] = fake_quantized(fp8[name], fp8[name + "_scale_inv"])
        else:
            fp8[name], dequantized[name] = tensor, tensor.float()
    write_folder(root / "fp8", fp8, config | dict(quantization_config=FP8_CONFIG))
    write_folder(root / "dequantized", dequantized, config | dict(dtype="float32"))
    return root


def test_an_fp8_release_runs_as_transformers_runs_its_dequantized_weights(release):
    ours = K3Model.from_pretrained(release / "fp8")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(release / "dequantized", dtype=torch.float32).eval()
    with torch.no_grad():
        assert relative_error(ours(tokens(1))[0], theirs(tokens(1)).logits) < 1e-4  # measured 1e-6


QUANTIZED = {"mixer.q_down.weight", "mixer.q_up.weight", "mixer.kv_down.weight", "mixer.k_up", "mixer.v_up",
             "mixer.out.weight", "ffn.gate", "ffn.up", "ffn.down", "ffn.experts.gate_up", "ffn.experts.down",
             "ffn.shared.gate", "ffn.shared.up", "ffn.shared.down"}  # K3Model's names of the quantized weights


def test_fp8_weights_are_within_e4m3_rounding_of_the_bf16_source(release):
    """Each dequantized weight within e4m3's rounding of its bf16 value: |Ŵ − W| ≤ 2⁻⁴ |W| (3 mantissa bits) +
    2⁻¹⁰ s (subnormals), s ≤ max |W| / 448; the tensors not quantized are equal."""
    fp8, source = K3Model.from_pretrained(release / "fp8"), K3Model.from_pretrained(release / "bf16")
    moved = set()
    for name, weight in source.state_dict().items():
        rounded = fp8.state_dict()[name]
        bound = 2 ** -4 * weight.abs() + 2 ** -10 * weight.abs().max() / E4M3_MAX
        assert ((rounded - weight).abs() <= bound).all(), name
        moved |= {name} if not torch.equal(rounded, weight) else set()
    assert moved == {name for name in source.state_dict() if name.split(".", 2)[-1] in QUANTIZED}


@torch.no_grad()
def test_fp8_logits_move_as_little_as_rounding_noise_moves_them(release):
    """The logits of the FP8 release move from its bf16 source's (‖Δ‖ / ‖logits‖ over 4 × 32 tokens) less than
    those of the source with every quantized weight multiplied by 1 + 2⁻⁴ u, u ~ U(−1, 1), noise of e4m3's
    rounding size: measured 0.25 and 0.28 (0.28 – 0.31 over four noise seeds) on this tiny model of O(1) signals,
    whose routed experts change choice under either."""
    fp8, source = K3Model.from_pretrained(release / "fp8"), K3Model.from_pretrained(release / "bf16")
    noisy = K3Model.from_pretrained(release / "bf16")
    generator = torch.Generator().manual_seed(0)
    for name, weight in noisy.named_parameters():
        if name.split(".", 2)[-1] in QUANTIZED:
            weight.mul_(1 + 2 ** -4 * (2 * torch.rand(weight.shape, generator=generator) - 1))
    ids = torch.randint(0, TINY["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0))
    exact = source(ids)[0]
    moved = lambda model: float((model(ids)[0] - exact).norm() / exact.norm())
    assert 0 < moved(fp8) < moved(noisy)


def test_fp8_weights_are_dequantized_to_the_requested_dtype(release):
    in_fp32 = K3Model.from_pretrained(release / "fp8").state_dict()
    in_bf16 = K3Model.from_pretrained(release / "fp8", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in in_bf16.parameters())
    assert all(torch.equal(p, in_fp32[n].bfloat16()) for n, p in in_bf16.named_parameters())


def test_generate_pretrained_runs_the_fp8_release(release, capsys):
    tokenizer = char_tokenizer()
    prompt = "the cat"
    model = K3Model.from_pretrained(release / "fp8")
    ids = model.generate(torch.tensor([tokenizer(prompt)["input_ids"]]), 8, temperature=0.0)
    expected = tokenizer.decode(ids[0, len(prompt):].tolist(), skip_special_tokens=True)
    assert main(["generate", "--pretrained", str(release / "fp8"), "--prompt", prompt, "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == prompt + expected + "\n" and expected


def test_no_shared_experts_loads_as_transformers_runs_it(tmp_path):
    torch.manual_seed(0)
    reference = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SIZES | dict(n_shared_experts=0)))
    randomize(reference, 2)
    reference.save_pretrained(tmp_path)  # the shared expert is stored with no rows
    ours = K3Model.from_pretrained(tmp_path)
    assert ours.cfg.n_shared_experts == 0
    with torch.no_grad():
        assert relative_error(ours(tokens(3))[0], reference.eval()(tokens(3)).logits) < 1e-4


def test_a_tied_k3_model_opens_in_transformers_with_its_head(tmp_path):
    torch.manual_seed(4)
    model = K3Model.from_config(tiny_kimi_linear(tie_embeddings=True)).eval()
    randomize(model, 5)
    model.save_pretrained(tmp_path)
    reference = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert relative_error(model(tokens(4))[0], reference(tokens(4)).logits) < 1e-4


# Kimi K2's config.json keys that differ from transformers' DeepSeek-V3 (rope_scaling as released, scaled down)
K2_KEYS = dict(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], rope_theta=50000.0,
               max_position_embeddings=64, rope_scaling=dict(type="yarn", factor=4.0, beta_fast=1.0, beta_slow=1.0,
                                                             mscale=1.0, mscale_all_dim=1.0,
                                                             original_max_position_embeddings=16))


def bpe_tokenizer_files(path) -> None:
    """A byte-level BPE of 64 tokens trained in memory on one sentence (tokenizer.json) and a tokenizer_config.json
    naming its class, as a release ships them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(["the cat sat on the mat and the dog sat on the log"] * 4, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>", unk_token="<unk>")))


@pytest.mark.parametrize("trust", [[], ["--trust-remote-code"]])
def test_a_kimi_k2_folder_generates_with_its_own_tokenizer(release, tmp_path, trust, capsys):
    """transformers' AutoTokenizer fails on a kimi_k2 config.json (no config class for it: AttributeError or
    ValueError, by its keys); the tokenizer comes from tokenizer_config.json instead, local files only."""
    folder = tmp_path / "k2"
    shutil.copytree(release / "bf16", folder, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    config = {key: value for key, value in json.loads((folder / pretrained.CONFIG_FILE).read_text()).items()
              if key != "rope_parameters"}  # K2 spells its YaRN the released way
    (folder / pretrained.CONFIG_FILE).write_text(json.dumps(config | K2_KEYS))
    bpe_tokenizer_files(folder)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    prompt = "the cat sat"
    ids = tokenizer(prompt)["input_ids"]
    continued = K3Model.from_pretrained(folder).generate(torch.tensor([ids]), 5, temperature=0.0)[0, len(ids):]
    assert main(["generate", "--pretrained", str(folder), "--prompt", prompt, "--max-new-tokens", "5",
                 "--temperature", "0", *trust]) == 0
    assert capsys.readouterr().out == prompt + tokenizer.decode(continued.tolist(), skip_special_tokens=True) + "\n"
