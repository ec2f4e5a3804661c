"""The one run loop on P ranks (``k3course train --ep P``, ``--dp-shard N --ep M``), every one on the mesh of
FSDP2 × EP: evaluation and checkpoints on their schedule, a signal that stops every rank at one step boundary, an
exact resume, --extend-to, sharded checkpoints that a one-process run continues and one-process checkpoints that
P ranks continue. Two or four spawned gloo ranks on a two-layer model and a few small text files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT

from k3course import checkpoint, train
from k3course.cli import main
from k3course.config import K3Config
from k3course.train.config import resolve_config
from k3course.train.generate import load_model

SMALL = K3Config.preset("tiny").replace(
    name="test", d_model=32, n_layers=2, kda_n_heads=2, kda_head_dim=16, mla_n_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, expert_dim=32,
    latent_dim=16, dense_ffn_dim=64, context_length=64)
EP_TRAIN = train.TrainConfig(steps=4, batch_size=2, seq_len=32, grad_accum=2, lr=3e-3, warmup_steps=2,
                             eval_every=0, eval_bytes=256, checkpoint_every=0)
STOP_IN_FORWARD = 5  # the first micro-batch of step 3 (two micro-batches a step)


def _interrupted_on_rank_1(model_config, seed, device):
    """A model that, on rank 1 only, sends its own process SIGINT in training forward number STOP_IN_FORWARD
    (spawned ranks import this factory by name from this module)."""
    model = train.build_model(model_config, seed, device)
    forwards = []

    def interrupt(module, _) -> None:
        forwards.extend([None] if module.training else [])
        if dist.get_rank() == 1 and len(forwards) == STOP_IN_FORWARD and module.training:
            os.kill(os.getpid(), signal.SIGINT)

    model.register_forward_pre_hook(interrupt)
    return model


@pytest.fixture
def run_toml(tmp_path, monkeypatch):
    """A run.toml of the small model on 30 small text files (the corpus cache in tmp_path)."""
    monkeypatch.setenv("K3COURSE_CACHE", str(tmp_path / "cache"))
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(30):
        (texts / f"n{i}.txt").write_text(f"note {i}: the cat sat on the mat, the dog ran.\n" * (20 + i))
    path = tmp_path / "run.toml"
    path.write_text(train.RunConfig(SMALL, EP_TRAIN, train.RunOptions(data=(str(texts),))).toml())
    return path


def _ep_train(*argv) -> int:
    return main(["train", "--ep", "2", "--threads", "1", *argv])


def _weights(out, step: int) -> dict[str, torch.Tensor]:
    return load_model(checkpoint.step_dir(out, step)).state_dict()


def test_an_ep_run_evaluates_and_checkpoints_on_schedule(tmp_path, run_toml, capsys):
    out = tmp_path / "run"
    assert _ep_train("--config", str(run_toml), "--steps", "6", "--set", "eval_every=2", "checkpoint_every=2",
                     "--out", str(out)) == 0
    assert "on 2 expert-parallel ranks: validation" in capsys.readouterr().out
    records = checkpoint.read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "val_bpb" in r] == [2, 4, 6]
    assert all(0 < r["val_bpb"] < 8 and r["tokens_per_s"] > 0 for r in records if "val_bpb" in r)
    assert [step for step, _ in checkpoint.checkpoints(out)] == [2, 4, 6]
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG" and (out / "config.toml").exists()
    saved = json.loads((checkpoint.step_dir(out, 6) / "config.json").read_text())
    assert saved["step"] == 6 and saved["train"]["eval_every"] == 2 and saved["model"]["n_routed_experts"] == 4
    assert sorted(path.name for path in checkpoint.step_dir(out, 6).iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "config.json"]  # each rank its pieces: a 1 × 2 mesh
    model = load_model(out)  # read in one process into the plain model: every expert
    assert model.moe_layers()[0].experts.gate_up.shape[0] == SMALL.n_routed_experts


def test_an_ep_run_stopped_by_sigint_on_one_rank_resumes_to_the_straight_runs_weights(tmp_path, run_toml, capsys):
    """SIGINT reaches rank 1 alone, during step 3: both ranks stop after step 3 with its checkpoint; resumed on
    two ranks, the run ends with the weights, losses and validation numbers of a straight two-rank run."""
    sets = ["--set", "eval_every=2", "checkpoint_every=2", "steps=6"]
    assert _ep_train("--config", str(run_toml), *sets, "--out", str(tmp_path / "straight")) == 0
    config = resolve_config(config_file=run_toml, sets=sets[1:])
    stopped = tmp_path / "stopped"
    with pytest.raises(train.TrainingInterrupted, match="SIGINT at step 3: checkpoint .* --resume") as interrupted:
        train.train(config, stopped, ranks=2, progress=False, model_factory=_interrupted_on_rank_1)
    assert interrupted.value.step == 3 and interrupted.value.signum == signal.SIGINT
    assert [step for step, _ in checkpoint.checkpoints(stopped)] == [2, 3]
    assert [r["step"] for r in checkpoint.read_metrics(stopped)] == [1, 2, 3]
    assert _ep_train("--out", str(stopped), "--resume") == 0
    resumed, straight = _weights(stopped, 6), _weights(tmp_path / "straight", 6)
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)
    numbers = lambda out: [(r["step"], r["loss"], r.get("val_bpb")) for r in checkpoint.read_metrics(out)]
    assert numbers(stopped) == numbers(tmp_path / "straight")
    capsys.readouterr()


def test_extend_to_on_ep_ranks_and_a_one_process_resume_of_an_ep_checkpoint(tmp_path, run_toml, capsys):
    """--extend-to on two ranks gives the run more steps on a new schedule tail; the same extension on one process
    from the same checkpoint takes the same steps, up to the ranks' rounding and histogram-estimated biases."""
    assert _ep_train("--config", str(run_toml), "--out", str(tmp_path / "ep")) == 0
    shutil.copytree(tmp_path / "ep", tmp_path / "one")
    assert _ep_train("--out", str(tmp_path / "ep"), "--extend-to", "6") == 0
    assert "from step 4 to 6: a new schedule tail" in capsys.readouterr().out
    assert main(["train", "--threads", "1", "--out", str(tmp_path / "one"), "--extend-to", "6"]) == 0
    records = {name: checkpoint.read_metrics(tmp_path / name) for name in ("ep", "one")}
    assert [r["step"] for r in records["ep"]] == [1, 2, 3, 4, 5, 6] and "val_bpb" in records["ep"][-1]
    saved = checkpoint.read_config(checkpoint.step_dir(tmp_path / "ep", 6))
    assert saved["extensions"] == [{"at_step": 4, "steps_before": 4, "steps_after": 6}]
    assert records["ep"][:4] == records["one"][:4]  # the EP run's first four steps, kept
    for ep_record, one_record in zip(records["ep"][4:], records["one"][4:]):
        assert ep_record["lr"] == one_record["lr"]
        assert ep_record["loss"] == pytest.approx(one_record["loss"], rel=1e-3)
    assert records["ep"][-1]["val_bpb"] == pytest.approx(records["one"][-1]["val_bpb"], rel=1e-3)  # windows shared out


def test_torchrun_ranks_run_the_same_loop_and_extend_a_run(tmp_path, run_toml):
    """``torchrun -m k3course.train``: two ranks evaluate and checkpoint on schedule, then extend the run."""
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "k3course.train", "--ep", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for argv in (["--config", str(run_toml), "--set", "eval_every=2", "checkpoint_every=2"], ["--extend-to", "6"]):
        done = subprocess.run([*launch, *argv], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "step 6: loss" in done.stdout
    records = checkpoint.read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "val_bpb" in r] == [2, 4, 6]
    assert [step for step, _ in checkpoint.checkpoints(out)] == [2, 4, 6]


def _up_to(run, copy, step: int):
    """``copy``: the run folder ``run`` with its checkpoints after ``step`` left out."""
    shutil.copytree(run, copy)
    for later, folder in checkpoint.checkpoints(copy):
        if later > step:
            shutil.rmtree(folder)
    return copy


def _close(got: dict, want: dict, weights: float, bias: float) -> bool:
    """Every tensor within ``weights`` of ``want`` (max |difference| / max |want|), the MoE biases within ``bias``."""
    relative = lambda name: float((got[name] - want[name]).abs().max() / want[name].abs().max().clamp_min(1e-30))
    return got.keys() == want.keys() and all(
        relative(name) <= (bias if name.endswith("ffn.bias") else weights) for name in want)


def test_a_dp_shard_by_ep_run_writes_sharded_checkpoints_that_resume_on_2_ranks_1_process_and_back(
        tmp_path, run_toml):
    """``--dp-shard 2 --ep 2``: four ranks on the FSDP2 × EP mesh, every rank writing its own pieces of each
    checkpoint (DCP). Its step-2 checkpoint resumes on two ranks (a 2 × 1 mesh) to the four ranks' step-3
    weights, and on one process, which goes on writing sharded checkpoints; one of those resumes on four ranks
    again (extended by a step) as on one process. Float32: the ranks sum in other orders (≤ 1e-5); one process
    reads the quantile bias exactly, the ranks off pooled histograms (the bias ≤ 0.1, within a bin)."""
    four = tmp_path / "four"
    assert main(["train", "--dp-shard", "2", "--ep", "2", "--threads", "1", "--config", str(run_toml), "--out",
                 str(four), "--set", "batch_size=4", "steps=3", "checkpoint_every=1"]) == 0
    assert sorted(path.name for path in checkpoint.step_dir(four, 2).iterdir()) == [
        ".metadata", *(f"__{rank}_0.distcp" for rank in range(4)), "config.json"]
    straight = load_model(four).state_dict()  # the plain model reads a sharded checkpoint in one process
    assert main(["train", "--dp-shard", "2", "--threads", "1", "--out", str(_up_to(four, tmp_path / "two", 2)),
                 "--resume"]) == 0
    assert _close(load_model(tmp_path / "two").state_dict(), straight, 1e-5, 1e-5)
    one = _up_to(four, tmp_path / "one", 2)
    assert main(["train", "--threads", "1", "--out", str(one), "--resume"]) == 0
    assert sorted(path.name for path in checkpoint.step_dir(one, 3).iterdir()) == [
        ".metadata", "__0_0.distcp", "config.json"]
    assert _close(load_model(one).state_dict(), straight, 1e-5, 0.1)
    back = _up_to(one, tmp_path / "back", 3)
    assert main(["train", "--dp-shard", "2", "--ep", "2", "--threads", "1", "--out", str(back), "--extend-to",
                 "4"]) == 0
    assert main(["train", "--threads", "1", "--out", str(one), "--extend-to", "4"]) == 0
    assert _close(load_model(back).state_dict(), load_model(one).state_dict(), 1e-5, 0.1)
    losses = lambda out: [record["loss"] for record in checkpoint.read_metrics(out)]
    assert losses(back) == pytest.approx(losses(one), rel=1e-5)
    assert losses(back)[:3] == pytest.approx(losses(four), rel=1e-6)


def test_a_mesh_run_stopped_by_sigint_on_one_rank_resumes_to_the_straight_runs_weights(tmp_path, run_toml, capsys):
    """``--dp-shard 2 --ep 2``: SIGINT reaches rank 1 alone, during step 3; all four ranks stop after step 3 with
    its complete sharded checkpoint (every rank's pieces, no .partial folder left). Resumed on the same mesh, the
    run ends bit for bit with the weights, losses and validation numbers of a straight four-rank run."""
    sets = ["--set", "eval_every=2", "checkpoint_every=2", "batch_size=4"]
    mesh = ["--dp-shard", "2", "--ep", "2", "--threads", "1"]
    assert main(["train", *mesh, "--config", str(run_toml), *sets, "--out", str(tmp_path / "straight")]) == 0
    config = resolve_config(config_file=run_toml, sets=sets[1:])
    stopped = tmp_path / "stopped"
    with pytest.raises(train.TrainingInterrupted, match="SIGINT at step 3: checkpoint .* --resume") as interrupted:
        train.train(config, stopped, ranks=4, dp_shard=2, progress=False, model_factory=_interrupted_on_rank_1)
    assert interrupted.value.step == 3 and interrupted.value.signum == signal.SIGINT
    assert [step for step, _ in checkpoint.checkpoints(stopped)] == [2, 3]
    assert sorted(path.name for path in checkpoint.step_dir(stopped, 3).iterdir()) == [
        ".metadata", *(f"__{rank}_0.distcp" for rank in range(4)), "config.json"]
    assert checkpoint.read_config(checkpoint.step_dir(stopped, 3))["step"] == 3
    assert not list(stopped.glob(".*.partial"))
    assert [r["step"] for r in checkpoint.read_metrics(stopped)] == [1, 2, 3]
    assert main(["train", *mesh, "--out", str(stopped), "--resume"]) == 0
    resumed, straight = load_model(stopped).state_dict(), load_model(tmp_path / "straight").state_dict()
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)
    numbers = lambda out: [(r["step"], r["loss"], r.get("val_bpb")) for r in checkpoint.read_metrics(out)]
    assert numbers(stopped) == numbers(tmp_path / "straight")
    capsys.readouterr()


def test_the_mesh_is_checked_before_any_rank_starts(tmp_path, run_toml):
    config = resolve_config(config_file=run_toml)
    with pytest.raises(ValueError, match="dp_shard must be a positive int dividing the 4 ranks, got 3"):
        train.train(config, tmp_path / "a", ranks=4, dp_shard=3)
    with pytest.raises(ValueError, match="train.batch_size 2 must be a multiple of the 4 ranks"):
        train.train(config, tmp_path / "a", ranks=4)
    with pytest.raises(ValueError, match="ep: 3 expert-parallel ranks must divide the model's 4 routed experts"):
        train.train(resolve_config(config_file=run_toml, sets=["batch_size=6"]), tmp_path / "a", ranks=6,
                    dp_shard=2)
    assert not (tmp_path / "a").exists()


def test_a_one_process_checkpoint_resumes_on_a_mesh(tmp_path, run_toml):
    """A one-process checkpoint (model.safetensors, state.pt) resumes on a 2 × 2 mesh: rank 0 rewrites it as a
    sharded checkpoint, which every rank reads its shards from, and removes it; the ranks' step 3 is one
    process's, to 1e-5 (float32, other summation orders) and the quantile biases to 0.1 (the ranks read them off
    pooled histograms), and the run then writes sharded checkpoints."""
    sets = ["--set", "batch_size=4", "steps=2"]
    assert main(["train", "--threads", "1", "--config", str(run_toml), "--out", str(tmp_path / "one"), *sets]) == 0
    assert (checkpoint.step_dir(tmp_path / "one", 2) / "model.safetensors").is_file()
    shutil.copytree(tmp_path / "one", tmp_path / "four")
    extend = ["--threads", "1", "--extend-to", "3", "--out"]
    assert main(["train", "--dp-shard", "2", "--ep", "2", *extend, str(tmp_path / "four")]) == 0
    assert main(["train", *extend, str(tmp_path / "one")]) == 0
    assert sorted(path.name for path in checkpoint.step_dir(tmp_path / "four", 3).iterdir()) == [
        ".metadata", *(f"__{rank}_0.distcp" for rank in range(4)), "config.json"]
    assert not (tmp_path / "four" / ".resharding").exists()
    assert _close(_weights(tmp_path / "four", 3), _weights(tmp_path / "one", 3), 1e-5, 0.1)
    losses = lambda out: [record["loss"] for record in checkpoint.read_metrics(out)]
    assert losses(tmp_path / "four") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
