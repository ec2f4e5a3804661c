"""Bad input to the loader and the command line: a wrong model is refused by name or loaded right, never loaded
silently wrong; every bad file, folder or setting ends `k3course` in one line naming it (exit 2, no traceback;
K3COURSE_DEBUG=1 shows it). FP8 releases, Kimi K2 tokenizers and transformers' side: tests/test_pretrained_fp8.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import safetensors.torch
import torch
from test_pretrained import tiny_kimi_linear

from k3course import cli, pretrained
from k3course.cli import main
from k3course.model import K3Model

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def saved(path, **changes) -> K3Model:
    """A seeded tiny Kimi Linear K3Model, saved in ``path`` as one model.safetensors."""
    torch.manual_seed(0)
    model = K3Model.from_config(tiny_kimi_linear().replace(**changes)).eval()
    model.save_pretrained(path)
    return model


def rewrite(path, tensors=lambda state: state, config=lambda hf: hf) -> None:
    """Change a saved folder: its tensors (``tensors(state)``) and its config.json (``config(hf)``)."""
    file = path / pretrained.SINGLE_FILE
    safetensors.torch.save_file(tensors(safetensors.torch.load_file(file)), file)
    hf = json.loads((path / pretrained.CONFIG_FILE).read_text())
    (path / pretrained.CONFIG_FILE).write_text(json.dumps(config(hf)))


def changed(state: dict, key: str, tensor: torch.Tensor) -> dict:
    return state | {key: tensor}


FP8 = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])


@pytest.mark.parametrize("change, named", [
    (dict(tensors=lambda s: changed(s, Q_PROJ, (s[Q_PROJ] * 8).long())), f"{Q_PROJ} holds int64; expected float32"),
    (dict(tensors=lambda s: changed(s, "model.layers.0.self_attn.A_log", s["model.layers.0.self_attn.A_log"] > 0)),
     "A_log holds bool"),
    (dict(tensors=lambda s: changed(s, Q_PROJ, s[Q_PROJ].to(torch.float8_e4m3fn)), config=lambda hf: hf | dict(
        quantization_config=FP8)), f"{Q_PROJ} is float8_e4m3fn but its block scales {Q_PROJ}_scale_inv are missing"),
    (dict(tensors=lambda s: s | {Q_PROJ: s[Q_PROJ].to(torch.float8_e4m3fn), f"{Q_PROJ}_scale_inv": torch.ones(1, 1)}),
     f"{Q_PROJ} is float8_e4m3fn but config.json has no quantization_config"),
    (dict(tensors=lambda s: s | {Q_PROJ: s[Q_PROJ].to(torch.float8_e4m3fn), f"{Q_PROJ}_scale_inv": torch.ones(2, 1)},
          config=lambda hf: hf | dict(quantization_config=FP8)), r"needs block scales of shape \(1, 1\).*got \(2, 1\)"),
    (dict(config=lambda hf: hf | dict(num_attention_heads=4)),
     r"kv_b_proj.weight has shape \(32, 8\), but config.json's num_attention_heads 4"),
    (dict(config=lambda hf: hf | dict(linear_num_heads=4)), r"A_log has shape \(1, 1, 2, 1\), but .*num_heads 4")])
def test_a_wrong_tensor_or_setting_is_refused_by_name(tmp_path, change, named):
    saved(tmp_path)
    rewrite(tmp_path, **change)
    with pytest.raises(pretrained.UnsupportedCheckpoint, match=named):
        K3Model.from_pretrained(tmp_path)


def test_a_stored_head_that_differs_from_the_embedding_is_the_head_said_once(tmp_path):
    model = saved(tmp_path)  # untied: embedding and head differ
    rewrite(tmp_path, config=lambda hf: hf | dict(tie_word_embeddings=True))
    with pytest.warns(UserWarning, match="lm_head.weight differs from the embedding") as said:
        loaded = K3Model.from_pretrained(tmp_path)
    assert len(said) == 1 and not loaded.cfg.tie_embeddings
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids)[0], model(ids)[0])


def test_a_tied_model_is_saved_with_its_head_and_read_back_tied(tmp_path):
    model = saved(tmp_path, tie_embeddings=True)
    stored = safetensors.torch.load_file(tmp_path / pretrained.SINGLE_FILE)
    assert torch.equal(stored["lm_head.weight"], model.embed.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert K3Model.from_pretrained(tmp_path).cfg.tie_embeddings


def test_fp8_dequantization_scales_each_block_and_keeps_the_partial_ones():
    """W[i, j] = q[i, j] · s[⌊i / b₀⌋, ⌊j / b₁⌋] on a 5 × 3 weight in 2 × 2 blocks (a partial last row and column)."""
    q = torch.arange(-7.0, 8.0).view(5, 3).to(torch.float8_e4m3fn)
    scales = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    expected = torch.tensor([[scales[i // 2, j // 2] * (3 * i + j - 7) for j in range(3)] for i in range(5)])
    assert torch.equal(pretrained.dequantize_fp8(q, scales, (2, 2)), expected)
    assert pretrained.dequantize_fp8(q, scales, (2, 2), torch.bfloat16).dtype == torch.bfloat16


# --- the command line: one line, exit status 2 ------------------------------------------------------------------

def _pytorch_bin_only(path):
    saved(path)
    (path / pretrained.SINGLE_FILE).rename(path / "pytorch_model.bin")


def _missing_shard(path):
    torch.manual_seed(0)
    K3Model.from_config(tiny_kimi_linear()).save_pretrained(path, max_shard_bytes=30_000)
    (path / "model-00002-of-00006.safetensors").unlink()


def _truncated(path):
    saved(path)
    data = (path / pretrained.SINGLE_FILE).read_bytes()
    (path / pretrained.SINGLE_FILE).write_bytes(data[:len(data) // 2])


def _json_text(name: str, text: str):
    def write(path):
        saved(path, vocab_size=256)
        (path / name).write_text(text)
    return write


def _config_without(key: str):
    return lambda path: saved(path) and rewrite(path, config=lambda hf: {k: v for k, v in hf.items() if k != key})


@pytest.mark.parametrize("make, named", [
    (lambda path: None, "nope does not exist; expected a checkpoint folder"),
    (lambda path: path.mkdir(), "nope is empty; expected a checkpoint folder"),
    (lambda path: path.write_text("x"), "nope is a file; expected a checkpoint folder"),
    (lambda path: path.mkdir() or (path / "x").touch(), "nope has no config.json"),
    (lambda path: path.mkdir() or _pytorch_bin_only(path), "holds pytorch_model.bin (pickled weights) only; convert it "
                                                           "to safetensors"),
    (lambda path: path.mkdir() or _missing_shard(path), "model-00002-of-00006.safetensors: missing"),
    (lambda path: path.mkdir() or _truncated(path), "model.safetensors: not a readable safetensors file"),
    (lambda path: path.mkdir() or _json_text("config.json", "{'model_type': 1}")(path), "config.json: not JSON"),
    (lambda path: path.mkdir() or _json_text("config.json", "[1, 2]")(path), "config.json: expected a JSON object"),
    (lambda path: path.mkdir() or _config_without("kv_lora_rank")(path), "config.json: no kv_lora_rank"),
    (lambda path: path.mkdir() or _json_text("tokenizer.json", "{")(path), "tokenizer.json: not JSON"),
    (lambda path: path.mkdir() or saved(path, vocab_size=300) and None,
     "holds no tokenizer, and its vocabulary (300 tokens) is not the 256 byte values")])
def test_generate_pretrained_names_the_bad_file_in_one_line(tmp_path, make, named, capsys):
    path = tmp_path / "nope"
    make(path)
    capsys.readouterr()
    assert main(["generate", "--pretrained", str(path), "--prompt", "ab", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3course generate: ") and named in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, named", [
    (["generate", "--checkpoint", "MISSING"], "MISSING"), (["eval", "--checkpoint", "MISSING"], "MISSING"),
    (["runs", "MISSING"], "MISSING"), (["train", "--device", "nonsense"], "--device: 'nonsense' is not a torch device"),
    (["experiments", "mqar-sweep", "--device", "nonsense"], "--device: 'nonsense'"),
    (["generate", "--pretrained", "MISSING", "--device", "cuda:0"], "--device: 'cuda:0', but this machine has 0 cuda"),
    (["eval", "--checkpoint", "MISSING", "--device", "cuda"], "--device: 'cuda', but this machine has 0 cuda")])
def test_every_command_names_bad_input_in_one_line(argv, named, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    argv = [str(tmp_path / "missing") if arg == "MISSING" else arg for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"k3course {argv[0]}: ") and named.replace("MISSING", "missing") in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(args):
        raise KeyError("a bug, not bad input")

    monkeypatch.setattr(cli, "_runs", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["runs", "anything"])


@pytest.mark.parametrize("debug", [False, True])
def test_k3course_debug_shows_the_traceback(tmp_path, debug):
    env = {key: value for key, value in os.environ.items() if key != cli.DEBUG_VARIABLE}
    env |= {cli.DEBUG_VARIABLE: "1"} if debug else {}
    done = subprocess.run([sys.executable, "-m", "k3course.cli", "generate", "--pretrained", str(tmp_path / "nope")],
                          env=env, capture_output=True, text=True)
    assert "nope does not exist" in done.stderr
    if debug:
        assert done.returncode == 1 and "Traceback" in done.stderr and "FileNotFoundError" in done.stderr
    else:
        assert done.returncode == 2 and done.stderr.count("\n") == 1
