"""Training loop, checkpoints and exact resume, and the train / generate commands, on a small real K3Model; runs as a
tool: TOML + --set, your own text, SIGINT and --resume, --extend-to, eval, runs, bfloat16."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import safetensors.torch
import torch
from helpers import ROOT

from k3course import checkpoint, data, train
from k3course.cli import main, parser
from k3course.config import K3Config
from k3course.layers.kda import KDACache
from k3course.moe.stats import load_violation
from k3course.train.config import TRAIN_PRESETS, read_saved_run, resolve_config, train_preset
from k3course.train.generate import generate_text, load_model
from k3course.train.step import (
    balance_experts,
    compile_for_training,
    forward_precision,
    lr_factor,
    make_optimizer,
    train_step,
)

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
    return train.train(train.RunConfig(SMALL, config), out, resume, corpus=corpus, progress=False)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [lr_factor(s, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[4] == 1.0
    assert all(a > b for a, b in zip(factors[4:], factors[5:]))
    assert lr_factor(20, 4, 20, 0.1) == pytest.approx(0.1)
    middle = 4 + 8  # halfway through the cosine: f = r + (1 − r)/2
    assert factors[middle] == pytest.approx(0.1 + 0.9 * 0.5)


def test_bad_train_settings_name_the_argument():
    with pytest.raises(ValueError, match="steps"):
        train.TrainConfig(steps=0)
    with pytest.raises(ValueError, match="grad_accum"):
        train.TrainConfig(grad_accum=0)
    with pytest.raises(ValueError, match="unknown training preset 'huge'"):
        train_preset("huge")


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


def test_unequal_micro_batches_with_ignored_targets_step_as_one_batch(corpus):
    """Micro-batches of 1 and 3 sequences, a third of one's targets ignored: the step's loss and gradient norm are
    those of the one batch holding them all (each micro-batch weighs by its counted targets, not 1 / A)."""
    inputs, targets = data.batch_at(corpus.train, 0, 4, 32, seed=0)
    targets = targets.clone()
    targets[1:, :20] = data.IGNORE
    reports = []
    for micro_batches in ([(inputs, targets)], [(inputs[:1], targets[:1]), (inputs[1:], targets[1:])]):
        model = train.build_model(SMALL, seed=0)
        optimizer, scheduler = make_optimizer(model, FAST)
        reports.append(train_step(model, optimizer, scheduler, micro_batches, 1.0))
    assert reports[1]["loss"] == pytest.approx(reports[0]["loss"], rel=1e-5)
    assert reports[1]["grad_norm"] == pytest.approx(reports[0]["grad_norm"], rel=1e-4)
    with pytest.raises(ValueError, match="micro_batches: every target is ignored"):
        train_step(model, optimizer, scheduler, [(inputs, torch.full_like(targets, data.IGNORE))], 1.0)


def test_a_step_updates_weights_and_the_balancing_bias(corpus):
    model = train.build_model(SMALL, seed=0)
    optimizer, scheduler = make_optimizer(model, FAST)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moe = model.moe_layers()[0]
    record = train_step(model, optimizer, scheduler, train.text_batches(corpus.train, FAST, "cpu")(0), 1.0)
    assert record["lr"] == pytest.approx(FAST.lr / FAST.warmup_steps)
    assert math.isfinite(record["loss"]) and record["max_violation"] >= 0
    assert len(record["max_violation_per_layer"]) == SMALL.n_moe_layers
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters() if p.dim() == 2)
    assert moe.bias.abs().sum() > 0  # quantile balancing moved it
    assert optimizer.param_groups[0]["weight_decay"] == FAST.weight_decay
    assert optimizer.param_groups[1]["weight_decay"] == 0.0


def test_the_bias_moves_in_the_optimizers_pre_step_hook_once_from_every_micro_batch(corpus):
    """make_optimizer's AdamW moves each MoE bias inside step(), before the weights, from the routing of all the
    step's micro-batches: two accumulated micro-batches leave it where one forward of both then update_bias()
    puts it; forwards and backwards alone never move it, and balance_experts after the step adds no second move."""
    first, second = train.text_batches(corpus.train, FAST, "cpu")(0)
    model = train.build_model(SMALL, seed=0)
    optimizer, _ = make_optimizer(model, FAST)
    whole = train.build_model(SMALL, seed=0)
    for inputs, targets in (first, second):
        model(inputs, targets=targets)[1].backward()
    assert all(moe.bias.abs().sum() == 0 for moe in model.moe_layers())  # not per micro-batch
    whole(torch.cat([first[0], second[0]]))
    for moe in whole.moe_layers():
        moe.update_bias()
    optimizer.step()
    moved = [moe.bias.clone() for moe in model.moe_layers()]
    assert all(torch.equal(got, want.bias) and got.abs().sum() > 0 for got, want in zip(moved, whole.moe_layers()))
    assert balance_experts(model)["max_violation_per_layer"] == [
        float(load_violation(moe.load_statistics()["load"])) for moe in _recorded(first, second)]
    assert all(torch.equal(got, moe.bias) for got, moe in zip(moved, model.moe_layers()))  # no second move


def _recorded(first, second):
    """The MoE layers of a fresh seed-0 model (the bias before any step) after forwards of both micro-batches."""
    fresh = train.build_model(SMALL, seed=0)
    for inputs, _ in (first, second):
        fresh(inputs)
    return fresh.moe_layers()


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
    losses = lambda out: [r["loss"] for r in checkpoint.read_metrics(out)]
    assert losses(resumed_out)[-2:] == losses(tmp_path / "straight")[-2:]
    state = lambda out: torch.load(checkpoint.step_dir(out, 4) / "state.pt", weights_only=True)["optimizer"]
    for key, moments in state(tmp_path / "straight")["state"].items():
        assert torch.equal(moments["exp_avg"], state(resumed_out)["state"][key]["exp_avg"])


def test_a_run_writes_metrics_plot_and_checkpoints(tmp_path, corpus):
    out = tmp_path / "run"
    _run(out, corpus)
    records = checkpoint.read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "val_bpb" in records[1] and "val_bpb" not in records[2] and records[-1]["val_bpb"] > 0
    assert records[-1]["val_bpb"] == pytest.approx(records[-1]["val_loss"] / math.log(2))
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert [step for step, _ in checkpoint.checkpoints(out)] == [2, 4]
    config = json.loads((checkpoint.step_dir(out, 4) / "config.json").read_text())
    assert config["step"] == 4 and config["train"]["steps"] == 4 and config["model"]["name"] == "test"
    assert "step" not in torch.load(checkpoint.step_dir(out, 4) / "state.pt", weights_only=True)  # stored once
    saved = read_saved_run(checkpoint.step_dir(out, 4))  # the typed record a resume reads
    assert saved.step == 4 and saved.config == train.RunConfig(SMALL, FAST) and saved.extensions == ()


def test_the_door_refuses_what_it_cannot_do_before_training(tmp_path, corpus):
    config = train.RunConfig(SMALL, FAST)
    with pytest.raises(ValueError, match="resume must be False, True or \"extend\", got 'yes'"):
        train.train(config, tmp_path / "a", resume="yes", corpus=corpus)
    with pytest.raises(ValueError, match="ranks must be a number of expert-parallel ranks ≥ 1, got 0"):
        train.train(config, tmp_path / "a", ranks=0, corpus=corpus)
    with pytest.raises(ValueError, match="compile: compiles a one-process run"):
        train.train(config, tmp_path / "a", ranks=2, compile=True)
    with pytest.raises(ValueError, match="corpus: spawned ranks read config.run's data"):
        train.train(config, tmp_path / "a", ranks=2, corpus=corpus)
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume"):
        train.train(config, tmp_path / "a", resume=True, corpus=corpus)
    assert not (tmp_path / "a").exists()


def test_the_runs_kernel_backend_is_built_into_every_layer_saved_and_used_on_resume(tmp_path, corpus,
                                                                                 monkeypatch):
    monkeypatch.setenv("K3COURSE_KERNELS", "torch")
    assert train.RunOptions().kernels == "torch"  # the environment variable is the default
    config = train.RunConfig(SMALL, dataclasses.replace(FAST, steps=2), train.RunOptions(kernels="loop"))
    out = tmp_path / "run"
    backends = lambda model: {type(m).__name__: m.kernels for m in model.modules() if hasattr(m, "kernels")}
    built_with = {"K3Model": "loop", "KimiDeltaAttention": "loop", "GatedMLA": "loop", "BlockAttnRes": "loop",
                  "RoutedExperts": "loop"}
    assert backends(train.train(config, out, corpus=corpus, progress=False)) == built_with
    saved = read_saved_run(checkpoint.latest_checkpoint(out))
    assert saved.config.run.kernels == "loop"
    extended = resolve_config(base=saved.config, sets=["train.steps=3"])
    assert backends(train.train(extended, out, "extend", corpus=corpus, progress=False)) == built_with
    with pytest.raises(ValueError, match="kernels must be one of auto, triton, torch, loop, got 'cuda'"):
        train.RunOptions(kernels="cuda")


def test_checkpoint_round_trip_and_clear_errors(tmp_path, corpus):
    model = _run(tmp_path / "run", corpus, config=FAST.replace(steps=1, checkpoint_every=0, eval_every=0))
    folder = checkpoint.step_dir(tmp_path / "run", 1)
    loaded = load_model(tmp_path / "run")  # a run folder: its latest checkpoint
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    other = train.build_model(SMALL.replace(d_model=48), seed=0)
    with pytest.raises(checkpoint.CheckpointError, match="does not fit"):
        checkpoint.load_weights(folder, other)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors"):
        load_model(folder)
    with pytest.raises(checkpoint.CheckpointError, match="holds no checkpoint"):
        load_model(tmp_path)
    (folder / "state.pt").unlink()  # loading a model needs its weights and config; resuming needs state.pt too
    with pytest.raises(checkpoint.CheckpointError, match="missing state.pt"):
        checkpoint.load_state(folder, *make_optimizer(model, FAST))
    with pytest.raises(checkpoint.CheckpointError, match="no folder"):
        load_model(tmp_path / "nowhere")


def test_a_failed_save_leaves_the_good_checkpoint(tmp_path, corpus, monkeypatch):
    model = _run(tmp_path / "run", corpus, config=FAST.replace(steps=1, checkpoint_every=0, eval_every=0))
    folder = checkpoint.step_dir(tmp_path / "run", 1)
    good = (folder / "model.safetensors").read_bytes()
    optimizer, scheduler = make_optimizer(model, FAST)
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(tmp_path / "run", 1, model, optimizer, scheduler, {})
    assert (folder / "model.safetensors").read_bytes() == good
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.toml", "loss.png", "metrics.jsonl",
                                                                  "step-000001"]


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
    model = load_model(tmp_path / "run")
    text = generate_text(model, "def ", max_new_tokens=8, temperature=0.0)
    assert text.startswith("def ") and len(text.encode("utf-8", errors="surrogateescape")) >= 4
    assert generate_text(model, "def ", 8, temperature=1.0, top_k=5, seed=3) == \
        generate_text(model, "def ", 8, temperature=1.0, top_k=5, seed=3)
    with pytest.raises(ValueError, match="prompt"):
        generate_text(model, "def \udcff", 4)


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
    monkeypatch.setitem(TRAIN_PRESETS, "test", ("tiny", FAST.replace(steps=1, eval_every=0, checkpoint_every=0)))
    monkeypatch.setattr(K3Config, "preset", classmethod(lambda cls, name: SMALL))
    assert main(["train", "--preset", "test", "--out", str(tmp_path / "run")]) == 0
    assert "bits/byte" in capsys.readouterr().out
    assert main(["train", "--preset", "test", "--out", str(tmp_path / "run"), "--resume", "--steps", "2"]) == 2
    assert "steps=1" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "5",
                 "--top-k", "3"]) == 0
    assert capsys.readouterr().out.startswith("def ")


# --- runs as a tool: configuration, your data, resume vs extend, precision -------------------------------

def _texts(folder, count=30):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"n{i}.txt").write_text(f"note {i}: the cat sat on the mat, the dog ran.\n" * (20 + i))
    return folder


def _config_file(path, train_config=FAST, **run):
    """A run.toml of the SMALL model and ``train_config`` (the file k3course train --print-config writes)."""
    path.write_text(train.RunConfig(SMALL, train_config, train.RunOptions(**run)).toml())
    return path


def test_settings_resolve_preset_then_file_then_flags_then_sets(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "small"\n[model]\nd_model = 64\n[train]\nsteps = 7\nlr = 1e-3\n'
                    '[run]\ndtype = "bfloat16"\n')
    resolved = resolve_config(config_file=toml, flags=[("--steps", "train.steps", 9)],
                                    sets=["train.lr=2e-3", "d_model=96", "model.mla_layers=[7]"])
    assert (resolved.model.name, resolved.model.d_model, resolved.model.mla_layers) == ("small", 96, (7,))
    assert (resolved.train.steps, resolved.train.lr, resolved.train.batch_size) == (9, 2e-3, 32)
    assert resolved.run.dtype == "bfloat16"
    assert resolve_config("tiny", toml).model.name == "tiny"  # a named preset wins over the file's
    (tmp_path / "printed.toml").write_text(resolved.toml())
    assert resolve_config(config_file=tmp_path / "printed.toml") == resolved


@pytest.mark.parametrize("sets, message", [
    (["train.stepz=3"], "--set train.stepz=3: [train] has no field 'stepz'; did you mean steps?"),
    (["lr=abc"], "--set lr=abc: train.lr expects a number, got 'abc'"),
    (["model.steps=3"], "--set model.steps=3: steps is a field of [train]: --set train.steps=3"),
    (["model.top_k=9"], "--set: model.top_k must be ≤ n_routed_experts (8), got 9"),
    (["train.betas=[0.9]"], "--set train.betas=[0.9]: train.betas expects a list of 2 numbers, got [0.9]"),
    (["run.dtype=float16"], "--set: run.dtype must be one of float32, bfloat16, got 'float16'"),
    (["run.kernels=cuda"], "--set: run.kernels must be one of auto, triton, torch, loop, got 'cuda'"),
    (["train.min_lr_ratio=2"], "--set: train.min_lr_ratio must be a number in [0, 1], got 2.0"),
    (["nonsense"], "--set nonsense: expected section.field=value"),
])
def test_bad_keys_and_values_are_named(sets, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_config(sets=sets)


def test_bad_config_files_and_flags_are_named(tmp_path):
    bad = tmp_path / "bad.toml"
    for text, message in (('[train]\nsteps = "many"\n', "train.steps expects an int, got 'many'"),
                          ("steps = 3\n", "unexpected top-level key 'steps'; it belongs in the [train] table"),
                          ("[train\n", "not valid TOML")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            resolve_config(config_file=bad)
    with pytest.raises(FileNotFoundError, match="config: no file at"):
        resolve_config(config_file=tmp_path / "none.toml")
    with pytest.raises(ValueError, match=re.escape("--steps: train.steps must be an int ≥ 1, got 0")):
        resolve_config(flags=[("--steps", "train.steps", 0)])


def test_a_run_on_a_folder_of_text_trains_evaluates_and_generates(tmp_path, monkeypatch, capsys, same_threads):
    monkeypatch.setenv("K3COURSE_CACHE", str(tmp_path / "cache"))
    texts, other = _texts(tmp_path / "texts"), _texts(tmp_path / "other", 3)
    toml = _config_file(tmp_path / "run.toml", FAST.replace(eval_bytes=512))
    run = str(tmp_path / "run")
    assert main(["train", "--config", str(toml), "--data", str(texts), "--out", run, "--threads", "1"]) == 0
    assert "bits/byte" in capsys.readouterr().out
    saved = json.loads((checkpoint.step_dir(run, 4) / "config.json").read_text())
    assert saved["run"]["data"] == [str(texts)] and saved["model"]["d_model"] == SMALL.d_model
    assert resolve_config(config_file=f"{run}/config.toml") == read_saved_run(checkpoint.step_dir(run, 4)).config
    assert main(["eval", "--checkpoint", run]) == 0
    report = capsys.readouterr().out
    final = checkpoint.read_metrics(run)[-1]["val_bpb"]
    assert f"{'model':<10}{final:8.3f} bits/byte" in report and "trigram" in report and "lzma-9" in report
    assert main(["eval", "--checkpoint", run, "--data", str(other), "--eval-bytes", "256"]) == 0
    assert "3 file(s)" in capsys.readouterr().out
    argv = ["generate", "--checkpoint", run, "--prompt", "note ", "--max-new-tokens", "12", "--top-k", "5"]
    assert main(argv) == 0
    whole = capsys.readouterr().out
    assert main([*argv, "--stream"]) == 0
    assert capsys.readouterr().out == whole and whole.startswith("note ")
    assert main(["runs", run, run, "--plot", str(tmp_path / "runs.png")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["run", "model", "params"] and f"{final:.3f}" in table[1]
    assert (tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_and_eval_name_what_is_missing(tmp_path, capsys):
    assert main(["runs", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def _cli(*argv):
    """``k3course ARGV`` in a fresh interpreter (this worktree's package first), as a Popen."""
    code = "from k3course.cli import main; raise SystemExit(main())"
    return subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _steps_done(out) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def test_sigint_writes_a_checkpoint_and_resume_is_bit_for_bit(tmp_path):
    """A run stopped by SIGINT after its first step, then resumed, ends with the weights of a straight run."""
    steps = 60
    toml = _config_file(tmp_path / "run.toml", FAST.replace(steps=steps, eval_every=0, checkpoint_every=0),
                        data=(str(_texts(tmp_path / "texts")),))
    common = ["train", "--config", str(toml), "--threads", "1"]
    stopped = _cli(*common, "--out", str(tmp_path / "stopped"))
    deadline = time.monotonic() + 120
    while _steps_done(tmp_path / "stopped") < 1 and stopped.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    stopped.send_signal(signal.SIGINT)
    _, err = stopped.communicate(timeout=120)
    assert stopped.returncode == 128 + signal.SIGINT, err
    at = checkpoint.checkpoints(tmp_path / "stopped")[-1][0]
    assert 1 <= at < steps and f"k3course train --out {tmp_path / 'stopped'} --resume" in err
    for process in (_cli("train", "--out", str(tmp_path / "stopped"), "--resume", "--threads", "1"),
                    _cli(*common, "--out", str(tmp_path / "straight"))):
        assert process.wait(timeout=300) == 0, process.stderr.read()
    weights = lambda out: safetensors.torch.load_file(checkpoint.step_dir(out, steps) / "model.safetensors")
    resumed, straight = weights(tmp_path / "stopped"), weights(tmp_path / "straight")
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)
    assert _steps_done(tmp_path / "stopped") == steps


def test_sigterm_stops_at_the_step_boundary_with_a_checkpoint(tmp_path, corpus):
    """SIGTERM during the first step's forward: the step finishes, its checkpoint is written, the handlers return."""
    def terminated_once(model_config, seed, device):
        model = train.build_model(model_config, seed, device)
        sent = []

        def terminate(*_) -> None:
            if not sent:
                sent.append(os.kill(os.getpid(), signal.SIGTERM))

        model.register_forward_pre_hook(terminate)
        return model

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(train.TrainingInterrupted, match="SIGTERM at step 1: checkpoint .* --resume") as stopped:
        train.train(train.RunConfig(SMALL, FAST), tmp_path / "run", corpus=corpus, progress=False,
                    model_factory=terminated_once)
    assert stopped.value.signum == signal.SIGTERM and stopped.value.step == 1
    assert [step for step, _ in checkpoint.checkpoints(tmp_path / "run")] == [1]
    assert signal.getsignal(signal.SIGTERM) == before


def test_extend_to_continues_on_a_new_schedule_tail(tmp_path, corpus, capsys):
    _run(tmp_path / "run", corpus)
    longer = FAST.replace(steps=8)
    train.train(train.RunConfig(SMALL, longer), tmp_path / "run", "extend", corpus=corpus, progress=False)
    records = checkpoint.read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[4]["lr"] == pytest.approx(FAST.lr * lr_factor(4, FAST.warmup_steps, 8, FAST.min_lr_ratio))
    saved = checkpoint.read_config(checkpoint.step_dir(tmp_path / "run", 8))
    assert saved["extensions"] == [{"at_step": 4, "steps_before": 4, "steps_after": 8}]
    assert saved["train"]["steps"] == 8
    straight = _run(tmp_path / "straight", corpus, config=longer)
    extended = load_model(tmp_path / "run")
    assert not all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), extended.state_dict().values()))
    with pytest.raises(ValueError, match="extend_to: must be more than the run's step 8, got 8"):
        train.train(train.RunConfig(SMALL, longer), tmp_path / "run", "extend", corpus=corpus, progress=False)


def test_cli_extend_to_says_it_is_a_new_schedule_and_resume_of_a_finished_run_does_nothing(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("K3COURSE_CACHE", str(tmp_path / "cache"))
    toml = _config_file(tmp_path / "run.toml", FAST.replace(steps=2), data=(str(_texts(tmp_path / "texts")),))
    out = str(tmp_path / "run")
    assert main(["train", "--config", str(toml), "--out", out]) == 0
    assert main(["train", "--out", out, "--resume"]) == 0
    assert "nothing to resume; --extend-to N" in capsys.readouterr().out
    assert main(["train", "--out", out, "--extend-to", "3"]) == 0
    said = capsys.readouterr().out
    assert "from step 2 to 3: a new schedule tail" in said and "not the same as a straight 3-step run" in said
    for argv, message in ((["--extend-to", "4", "--steps", "4"], "leave out --steps"),
                          (["--extend-to", "4", "--resume"], "use one"),
                          (["--resume", "--set", "train.lr=1"], "train.lr=0.003")):
        assert main(["train", "--out", out, *argv]) == 2
        assert message in capsys.readouterr().err


def test_resume_refuses_changed_files(tmp_path, monkeypatch):
    monkeypatch.setenv("K3COURSE_CACHE", str(tmp_path / "cache"))
    options = train.RunOptions(data=(str(_texts(tmp_path / "texts")),))
    settings = FAST.replace(steps=2, eval_every=0, checkpoint_every=1)
    train.train(train.RunConfig(SMALL, settings, options), tmp_path / "run", progress=False)
    shutil.rmtree(checkpoint.step_dir(tmp_path / "run", 2))  # as if stopped after step 1
    (tmp_path / "texts" / "n0.txt").write_text("rewritten\n" * 50)
    with pytest.raises(ValueError, match="data: the files changed since .* --extend-to N trains on the new bytes"):
        train.train(train.RunConfig(SMALL, settings, options), tmp_path / "run", resume=True, progress=False)


def test_bfloat16_runs_the_forward_in_bf16_and_keeps_weights_and_kda_states_fp32(corpus):
    model = train.build_model(SMALL, seed=0)
    optimizer, scheduler = make_optimizer(model, FAST)
    batches = train.text_batches(corpus.train, FAST, "cpu")(0)
    record = train_step(model, optimizer, scheduler, batches, FAST.grad_clip, torch.bfloat16)
    assert math.isfinite(record["loss"]) and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
    with forward_precision("cpu", torch.bfloat16):
        logits, _, cache = model(batches[0][0])
    states = [layer.state for layer in cache.layers if isinstance(layer, KDACache)]
    assert logits.dtype == torch.bfloat16 and states and all(s.dtype == torch.float32 for s in states)


def test_train_help_lists_every_option_with_its_default_and_every_field(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    (train_parser,) = [p for name, p in parser()._subparsers._group_actions[0].choices.items() if name == "train"]
    options = [a for a in train_parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) == 18 and all("default" in a.help for a in options), [a.dest for a in options]
    assert all(a.option_strings[0] in text for a in options)
    for cls in (K3Config, train.TrainConfig, train.RunOptions):
        assert all(f"\n{f.name} = " in text for f in dataclasses.fields(cls)), cls


# --- torch.compile ---------------------------------------------------------------------------------------

def _compiled_steps(corpus, steps: int, **compile_options):
    """Losses of ``steps`` steps (grad_accum 2) of a compiled SMALL model, and dynamo's counters after the first
    step and after the last: (losses, graphs after step 1, graphs at the end, graph breaks)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = train.build_model(SMALL, seed=0)
    optimizer, scheduler = make_optimizer(model, FAST)
    compile_for_training(model, FAST, **compile_options)
    losses, graphs = [], []
    for step in range(steps):
        batches = train.text_batches(corpus.train, FAST, "cpu")(step)
        losses.append(train_step(model, optimizer, scheduler, batches, FAST.grad_clip)["loss"])
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return losses, graphs, sum(counters["graph_break"].values())


def test_the_compiled_step_has_no_graph_break_and_no_recompile_after_step_one(corpus):
    """5 steps of 2 micro-batches: the first step compiles its graphs, later steps add none; no graph break; the
    losses are the eager run's (aot_eager traces forward and backward as inductor does, without codegen)."""
    losses, graphs, breaks = _compiled_steps(corpus, 5, backend="aot_eager")
    assert breaks == 0
    assert graphs[0] >= 1 and graphs[1:] == [graphs[0]] * 4, graphs
    model = train.build_model(SMALL, seed=0)
    optimizer, scheduler = make_optimizer(model, FAST)
    eager = [train_step(model, optimizer, scheduler, train.text_batches(corpus.train, FAST, "cpu")(step),
                              FAST.grad_clip)["loss"] for step in range(5)]
    assert losses == pytest.approx(eager, rel=1e-5)


def test_the_routing_record_has_a_fixed_shape_and_grows_only_when_a_step_brings_more_tokens():
    from k3course.moe import MoE

    layer = MoE(8, 4, 2, balancing="quantile").train()
    layer.reserve_statistics(12)
    buffer = layer.balancer.recorded_scores
    for _ in range(3):
        layer(torch.randn(4, 8))
    assert layer.balancer.recorded_scores is buffer and buffer.shape == (12, 4)
    layer(torch.randn(5, 8))  # 17 tokens > 12: doubles
    assert layer.balancer.recorded_scores.shape == (24, 4) and layer.balancing_statistics()["scores"].shape == (17, 4)
    with pytest.raises(ValueError, match="tokens"):
        layer.reserve_statistics(-1)
    assert layer.bfloat16().balancer.recorded_scores.dtype == torch.float32  # routing statistics stay fp32


def test_a_compiled_run_trains_as_the_eager_run_and_the_cli_refuses_it_with_expert_parallel(tmp_path, corpus,
                                                                                              capsys):
    """Inductor (the default backend, code generated for this CPU): a 2-step run's losses are the eager run's to
    fp32 rounding, and its checkpoint loads into an uncompiled model (same state_dict keys)."""
    short = FAST.replace(steps=2, eval_every=0, checkpoint_every=0, eval_bytes=256)
    torch._dynamo.reset()
    compiled = train.train(train.RunConfig(SMALL, short), tmp_path / "compiled", corpus=corpus, progress=False,
                           compile=True)
    torch._dynamo.reset()
    train.train(train.RunConfig(SMALL, short), tmp_path / "eager", corpus=corpus, progress=False)
    losses = lambda out: [r["loss"] for r in checkpoint.read_metrics(out)]
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4)
    assert "_orig_mod" not in "".join(compiled.state_dict())
    load_model(tmp_path / "compiled")
    args = ["train", "--preset", "tiny", "--out", str(tmp_path / "ep"), "--ep", "2", "--compile"]
    assert main(args) == 2 and "--compile" in capsys.readouterr().err
    assert parser().parse_args(["train", "--compile"]).compile
