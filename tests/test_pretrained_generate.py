"""`k3course generate --pretrained PATH`: a checkpoint transformers wrote, run by K3Model.from_pretrained with the
checkpoint's own tokenizer, continues a prompt as transformers' own model does (greedy); and lesson 15's numbers
for Kimi-Linear-48B-A3B come from the preset. The transformers checks need the ``oracle`` extra (skipped cleanly
without it); a course model saved without a tokenizer generates on UTF-8 bytes without it."""

from __future__ import annotations

import pytest
import torch

from k3course.cli import main, terminal_safe
from k3course.config import K3Config
from k3course.lessons import kimi_linear
from k3course.model import K3Model
from k3course.pretrained_generation import load_tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    pytest.importorskip("transformers", minversion="5.23")
    return kimi_linear.tiny_kimi_linear(tmp_path_factory.mktemp("kimi_linear"))


@torch.no_grad()
def greedy_reference(model, ids: list[int], steps: int) -> list[int]:
    """transformers' model, argmax token by token with a full forward each step (no cache)."""
    tokens = torch.tensor([ids])
    with kimi_linear.torch_kda_paths():
        for _ in range(steps):
            tokens = torch.cat([tokens, model(tokens).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return tokens[0, len(ids):].tolist()


def test_generate_pretrained_continues_as_transformers_does(saved, capsys):
    reference, path = saved
    tokenizer = load_tokenizer(path)
    prompt = "the cat sat on"
    expected = tokenizer.decode(greedy_reference(reference, tokenizer(prompt)["input_ids"], 12),
                                skip_special_tokens=True)
    assert main(["generate", "--pretrained", str(path), "--prompt", prompt, "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed == prompt + expected + "\n" and len(expected) > 0


def test_the_tokenizer_is_the_checkpoints_own(saved):
    tokenizer = load_tokenizer(saved[1])
    ids = tokenizer("the cat")["input_ids"]
    assert len(ids) == 7 and max(ids) < kimi_linear.TINY["vocab_size"]
    assert tokenizer.decode(ids) == "the cat"


def test_a_checkpoint_without_tokenizer_or_byte_vocabulary_is_refused(saved, tmp_path, capsys):
    for item in saved[1].iterdir():
        if not item.name.startswith("tokenizer"):
            (tmp_path / item.name).symlink_to(item)
    assert load_tokenizer(tmp_path) is None
    assert main(["generate", "--pretrained", str(tmp_path), "--prompt", "x"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_kimi_linear_48b_needs():
    """91.5 GiB of bf16 weights, ~6.3 GFLOP and ~5.8 GiB of weights read per decoded token."""
    needs = kimi_linear.decode_needs(K3Config.preset("kimi-linear-48b"))
    assert round(needs.weight_bytes / 2**30, 1) == 91.5
    assert round(needs.flops_per_token / 1e9, 1) == 6.3 and round(needs.read_bytes_per_token / 2**30, 1) == 5.8
    assert needs.read_bytes_per_token < needs.weight_bytes / 10  # 3B of 48B parameters active


def test_a_course_model_without_tokenizer_generates_on_bytes(tmp_path, capsys):
    """A Kimi-Linear-shaped K3Model with the 256 byte values as its vocabulary, saved by save_pretrained (no
    tokenizer): the prompt goes in as UTF-8 bytes and the greedy continuation is the model's own, printed with its
    control characters escaped."""
    cfg = K3Config.preset("kimi-linear-48b").replace(
        name="byte kimi linear", vocab_size=256, d_model=32, n_layers=2, mla_layers=(1,), kda_n_heads=2,
        kda_head_dim=8, mla_n_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=4, top_k=2, expert_dim=16, dense_ffn_dim=48, pad_token_id=None)
    torch.manual_seed(0)
    model = K3Model.from_config(cfg).eval()
    model.save_pretrained(tmp_path)
    expected = model.generate(torch.tensor([list(b"abc")]), 6, temperature=0.0)[0, 3:].tolist()
    assert main(["generate", "--pretrained", str(tmp_path), "--prompt", "abc", "--max-new-tokens", "6",
                 "--temperature", "0"]) == 0
    # the terminal gets the model's control bytes (here a bell, \x07) escaped
    assert capsys.readouterr().out == terminal_safe("abc" + bytes(expected).decode(errors="replace")) + "\n"
