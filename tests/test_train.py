"""Training loop, checkpoints and exact resume, and the train / generate commands, on a small real K3Model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from k3course import checkpoint, data, train
from k3course.cli import main
from k3course.config import K3Config

# Two layers: KDA + dense FFN, then MLA + latent MoE (the tiny preset's kinds, at a quarter of its width).
SMALL = K3Config.preset("tiny").replace(
    name="test", d_model=32, n_layers=2, kda_n_heads=2, kda_head_dim=16, mla_n_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, expert_dim=32,
    latent_dim=16, dense_ffn_dim=64, context_length=64)
FAST = train.TrainConfig(steps=4, batch_size=2, seq_len=32, grad_accum=2, lr=3e-3, warmup_steps=2, eval_every=2,
                         eval_bytes=256, checkpoint_every=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lib")
    (root / "pkg").mkdir()
    for i in range(20):  # pkg/m1, m5, m6 and m12 are the validation files
        (root / "pkg" / f"m{i}.py").write_bytes(f"def f{i}(x):\n    return x * {i} + 1\n".encode() * 8)
    return data.stdlib_corpus(root, cache=tmp_path_factory.mktemp("cache"))


def _run(out, corpus, resume=False, config=FAST):
    return train.run(SMALL, config, out, resume=resume, corpus=corpus, progress=False)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [train.lr_factor(s, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[4] == 1.0
    assert all(a > b for a, b in zip(factors[4:], factors[5:]))
    assert train.lr_factor(20, 4, 20, 0.1) == pytest.approx(0.1)
    middle = 4 + 8  # halfway through the cosine: f = r + (1 − r)/2
    assert factors[middle] == pytest.approx(0.1 + 0.9 * 0.5)


def test_bad_train_settings_name_the_argument():
    with pytest.raises(ValueError, match="steps"):
        train.TrainConfig(steps=0)
    with pytest.raises(ValueError, match="grad_accum"):
        train.TrainConfig(grad_accum=0)
    with pytest.raises(ValueError, match="unknown training preset 'huge'"):
        train.train_preset("huge")


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_batch(corpus):
    model = train.build_model(SMALL, seed=0)
    inputs, targets = data.batch_at(corpus.train, 0, 4, 32, seed=0)
    model(inputs, targets=targets)[1].backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for half in (slice(0, 2), slice(2, 4)):
        (model(inputs[half], targets=targets[half])[1] / 2).backward()
    for expected, param in zip(whole, model.parameters()):
        torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-6)


def test_a_step_updates_weights_and_the_balancing_bias(corpus):
    model = train.build_model(SMALL, seed=0)
    optimizer, scheduler = train.make_optimizer(model, FAST)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moe = model.moe_layers()[0]
    record = train.train_step(model, optimizer, scheduler, train._micro_batches(corpus.train, 0, FAST, "cpu"), 1.0)
    assert record["lr"] == pytest.approx(FAST.lr / FAST.warmup_steps)
    assert math.isfinite(record["loss"]) and record["max_violation"] >= 0
    assert len(record["max_violation_per_layer"]) == SMALL.n_moe_layers
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters() if p.dim() == 2)
    assert moe.bias.abs().sum() > 0  # quantile balancing moved it
    assert optimizer.param_groups[0]["weight_decay"] == FAST.weight_decay
    assert optimizer.param_groups[1]["weight_decay"] == 0.0


def test_resume_from_the_middle_checkpoint_is_exact(tmp_path, corpus):
    straight = _run(tmp_path / "straight", corpus)
    resumed_out = tmp_path / "resumed"
    resumed_out.mkdir()
    middle = checkpoint.step_dir(tmp_path / "straight", 2)
    (resumed_out / middle.name).mkdir()
    for name in checkpoint.FILES:
        (resumed_out / middle.name / name).write_bytes((middle / name).read_bytes())
    resumed = _run(resumed_out, corpus, resume=True)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    losses = lambda out: [r["loss"] for r in train._Metrics.read(out)]
    assert losses(resumed_out)[-2:] == losses(tmp_path / "straight")[-2:]
    state = lambda out: torch.load(checkpoint.step_dir(out, 4) / "state.pt", weights_only=True)["optimizer"]
    for key, moments in state(tmp_path / "straight")["state"].items():
        assert torch.equal(moments["exp_avg"], state(resumed_out)["state"][key]["exp_avg"])


def test_a_run_writes_metrics_plot_and_checkpoints(tmp_path, corpus):
    out = tmp_path / "run"
    _run(out, corpus)
    records = train._Metrics.read(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "val_bpb" in records[1] and "val_bpb" not in records[2] and records[-1]["val_bpb"] > 0
    assert records[-1]["val_bpb"] == pytest.approx(records[-1]["val_loss"] / math.log(2))
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert [step for step, _ in checkpoint.checkpoints(out)] == [2, 4]
    config = json.loads((checkpoint.step_dir(out, 4) / "config.json").read_text())
    assert config["step"] == 4 and config["train"]["steps"] == 4 and config["model"]["name"] == "test"


def test_checkpoint_round_trip_and_clear_errors(tmp_path, corpus):
    model = _run(tmp_path / "run", corpus, config=FAST.replace(steps=1, checkpoint_every=0, eval_every=0))
    folder = checkpoint.step_dir(tmp_path / "run", 1)
    loaded = train.load_model(tmp_path / "run")  # a run folder: its latest checkpoint
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    other = train.build_model(SMALL.replace(d_model=48), seed=0)
    with pytest.raises(checkpoint.CheckpointError, match="does not fit"):
        checkpoint.load_weights(folder, other)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors"):
        train.load_model(folder)
    with pytest.raises(checkpoint.CheckpointError, match="holds no checkpoint"):
        train.load_model(tmp_path)
    (folder / "state.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="missing state.pt"):
        train.load_model(folder)
    with pytest.raises(checkpoint.CheckpointError, match="no folder"):
        train.load_model(tmp_path / "nowhere")


def test_a_failed_save_leaves_the_good_checkpoint(tmp_path, corpus, monkeypatch):
    model = _run(tmp_path / "run", corpus, config=FAST.replace(steps=1, checkpoint_every=0, eval_every=0))
    folder = checkpoint.step_dir(tmp_path / "run", 1)
    good = (folder / "model.safetensors").read_bytes()
    optimizer, scheduler = train.make_optimizer(model, FAST)
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(tmp_path / "run", 1, model, optimizer, scheduler, {})
    assert (folder / "model.safetensors").read_bytes() == good
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["loss.png", "metrics.jsonl", "step-000001"]


def test_out_and_resume_errors(tmp_path, corpus):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="out"):
        _run(afile, corpus)
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume"):
        _run(tmp_path / "empty", corpus, resume=True)
    _run(tmp_path / "run", corpus, config=FAST.replace(steps=1, checkpoint_every=0, eval_every=0))
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        _run(tmp_path / "run", corpus, config=FAST.replace(steps=1, checkpoint_every=0, eval_every=0))
    with pytest.raises(ValueError, match="lr="):
        _run(tmp_path / "run", corpus, resume=True, config=FAST.replace(steps=1, checkpoint_every=0,
                                                                         eval_every=0, lr=1e-3))


def test_generate_continues_the_prompt(tmp_path, corpus):
    _run(tmp_path / "run", corpus, config=FAST.replace(steps=1, checkpoint_every=0, eval_every=0))
    model = train.load_model(tmp_path / "run")
    text = train.generate_text(model, "def ", max_new_tokens=8, temperature=0.0)
    assert text.startswith("def ") and len(text.encode("utf-8", errors="surrogateescape")) >= 4
    assert train.generate_text(model, "def ", 8, temperature=1.0, top_k=5, seed=3) == \
        train.generate_text(model, "def ", 8, temperature=1.0, top_k=5, seed=3)
    with pytest.raises(ValueError, match="prompt"):
        train.generate_text(model, "def \udcff", 4)


def test_cli_bad_input_gives_clear_errors(tmp_path, capsys):
    afile = tmp_path / "file"
    afile.write_text("x")
    for argv, message in ((["train", "--preset", "huge"], "preset"), (["train", "--steps", "0"], "steps"),
                          (["train", "--out", str(afile)], "is a file"),
                          (["generate", "--checkpoint", str(tmp_path), "--prompt", "x"], "checkpoint")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_cli_train_then_generate(tmp_path, corpus, monkeypatch, capsys):
    monkeypatch.setattr(data, "stdlib_corpus", lambda: corpus)
    monkeypatch.setitem(train.TRAIN_PRESETS, "test", ("tiny", FAST.replace(steps=1, eval_every=0, checkpoint_every=0)))
    monkeypatch.setattr(K3Config, "preset", classmethod(lambda cls, name: SMALL))
    assert main(["train", "--preset", "test", "--out", str(tmp_path / "run")]) == 0
    assert "bits/byte" in capsys.readouterr().out
    assert main(["train", "--preset", "test", "--out", str(tmp_path / "run"), "--resume", "--steps", "2"]) == 2
    assert "steps=1" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "5",
                 "--top-k", "3"]) == 0
    assert capsys.readouterr().out.startswith("def ")
