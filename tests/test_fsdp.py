"""FSDP2 × expert parallelism on a 2-D mesh ("dp_shard", "ep"), four gloo ranks forked from this process: the
layouts 2 × 2, 4 × 1 and 1 × 4 train a small K3 to the weights of one rank, in float64 (so that the ranks'
other summation order stays far below every tolerance), with quantile balancing pooled over all ranks,
gradient accumulation over micro-batches of unequal sizes, clipping by the global norm (active: the norm is
~40× the limit) and a rank whose tokens send nothing to some expert; and sharded checkpoints (DCP) that resume
exactly, also on other meshes; and the one Hugging Face folder the ranks write of a sharded model, gathered
tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from k3course import layout, pretrained_save
from k3course.config import K3Config
from k3course.distributed import keep_experts, make_mesh, parallelize, run_ranks
from k3course.distributed.cost import training_bytes_per_rank
from k3course.distributed.sharded_checkpoint import latest_sharded, step_folder
from k3course.lessons.ep_workers import bytes_held, checkpointed_steps, pretrained_folders, sharded_steps
from k3course.train import TrainConfig, build_model
from k3course.train.step import make_optimizer, train_step

MODEL = K3Config.preset("tiny").replace(
    name="test", d_model=32, n_layers=2, kda_n_heads=2, kda_head_dim=16, mla_n_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, top_k=2,
    expert_dim=32, latent_dim=16, dense_ffn_dim=64, context_length=64)
TRAIN = TrainConfig(steps=3, batch_size=4, seq_len=4, grad_accum=2, warmup_steps=1, grad_clip=0.05)
LAYOUTS = [(2, 2), (4, 1), (1, 4)]
TOLERANCE = 1e-12  # relative, per tensor, float64


def _batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step two micro-batches of 4 and 8 windows of 4 bytes (each rank reads 1 and 2 of them)."""
    generator = torch.Generator().manual_seed(0)
    windows = lambda rows: torch.randint(0, 256, (rows, TRAIN.seq_len + 1), generator=generator)
    return [[(w[:, :-1], w[:, 1:]) for w in (windows(4), windows(8))] for _ in range(TRAIN.steps)]


@pytest.fixture(scope="module")
def runs() -> dict:
    """{(dp_shard, ep): the ranks' results} for one rank and the three four-rank layouts."""
    case = {"model": MODEL, "train": TRAIN, "batches": _batches(), "dtype": torch.float64}
    return {mesh: run_ranks(sharded_steps, mesh[0] * mesh[1], {**case, "mesh": mesh}, timeout_s=600,
                            start_method="fork")
            for mesh in [(1, 1), *LAYOUTS]}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("mesh", LAYOUTS, ids=lambda mesh: f"{mesh[0]}x{mesh[1]}")
def test_four_ranks_train_to_the_weights_of_one(runs, mesh):
    (one,) = runs[(1, 1)]
    for rank in runs[mesh]:
        assert rank["state"].keys() == one["state"].keys()
        for name, tensor in one["state"].items():
            assert _relative(rank["state"][name], tensor) <= TOLERANCE, name
        for got, want in zip(rank["records"], one["records"]):
            assert got["lr"] == want["lr"] and got["max_violation_per_layer"] == want["max_violation_per_layer"]
            assert abs(got["loss"] - want["loss"]) <= TOLERANCE * want["loss"]
            assert abs(got["grad_norm"] - want["grad_norm"]) <= TOLERANCE * want["grad_norm"]
    assert all(record["grad_norm"] > 20 * TRAIN.grad_clip for record in one["records"])  # clipping acts
    assert any(any(rank["idle_expert"]) for rank in runs[mesh])  # some rank sent some expert nothing
    biases = [name for name in one["state"] if name.endswith("ffn.bias")]
    assert biases and all(one["state"][name].abs().sum() > 0 for name in biases)  # quantile balancing moved them


def test_one_rank_takes_the_one_process_first_step(runs):
    """The one-rank mesh is the plain model: its first step (bias still 0) is the one-process step. Later steps
    differ within the quantile rule's histogram bin (ranks read the quantile off pooled histograms)."""
    model = build_model(MODEL, TRAIN.seed).double()
    optimizer, scheduler = make_optimizer(model, TRAIN)
    want = train_step(model, optimizer, scheduler, _batches()[0], TRAIN.grad_clip)
    got = runs[(1, 1)][0]["records"][0]
    assert abs(got["loss"] - want["loss"]) <= TOLERANCE * want["loss"]
    assert abs(got["grad_norm"] - want["grad_norm"]) <= TOLERANCE * want["grad_norm"]
    assert got["max_violation_per_layer"] == want["max_violation_per_layer"]  # the same routing


def test_clear_errors():
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_mesh(2, 2)
    with pytest.raises(ValueError, match="ep must be a positive int"):
        make_mesh(2, 0)
    with pytest.raises(ValueError, match="mesh must be a DeviceMesh"):
        parallelize(build_model(MODEL, 0), mesh=(2, 2))


# --- sharded checkpoints (DCP) ------------------------------------------------------------------------------

def _checkpointed(mesh, **options) -> dict:
    """The gathered state after TRAIN.steps of :func:`checkpointed_steps` on ``mesh`` (rank 0's)."""
    case = {"model": MODEL, "train": TRAIN, "batches": _batches(), "dtype": torch.float64, "mesh": mesh, **options}
    return run_ranks(checkpointed_steps, mesh[0] * mesh[1], case, timeout_s=600, start_method="fork")[0]


def test_a_sharded_checkpoint_resumes_exactly_and_on_other_meshes(tmp_path):
    """Written at step 2 on 2 × 2 ranks, each writing its shards: resumed on 2 × 2 the run ends bit for bit as
    the straight run; on 1 × 2 and on one rank, to 1e-12 (float64; the sums run in another order). A checkpoint
    written by one rank resumes on 4 × 1 as well."""
    straight = _checkpointed((2, 2), out=str(tmp_path / "four"), save_at=2)
    saved = step_folder(tmp_path / "four", 2)
    assert sorted(path.name for path in saved.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(4)),
                                                             "config.json"]
    again = _checkpointed((2, 2), load=saved)
    assert all(torch.equal(again[name], tensor) for name, tensor in straight.items())
    for mesh in [(1, 2), (1, 1)]:
        resumed = _checkpointed(mesh, load=saved)
        assert all(_relative(resumed[name], tensor) <= TOLERANCE for name, tensor in straight.items()), mesh
    _checkpointed((1, 1), out=str(tmp_path / "one"), save_at=2)
    back = _checkpointed((4, 1), load=step_folder(tmp_path / "one", 2))
    assert all(_relative(back[name], tensor) <= TOLERANCE for name, tensor in straight.items())


def test_an_interrupted_write_leaves_the_previous_checkpoint(tmp_path):
    """A checkpoint is written into a hidden .partial folder and renamed when every rank is done: a write cut
    short leaves that folder, which is no checkpoint."""
    _checkpointed((1, 1), out=str(tmp_path), save_at=2)
    complete = step_folder(tmp_path, 2)
    partial = tmp_path / ".step-000003.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes((complete / "__0_0.distcp").read_bytes())  # pieces, no metadata yet
    assert latest_sharded(tmp_path) == complete
    assert latest_sharded(tmp_path / "nothing") is None


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4)], ids=lambda mesh: f"{mesh[0]}x{mesh[1]}")
def test_what_a_rank_holds_is_the_accountings_prediction(mesh):
    """Weights, gradients and AdamW's moments in each rank's local shards, float32, within 5 % of
    cost.training_bytes_per_rank (the shards of a dimension 4 does not divide are uneven)."""
    case = {"model": MODEL, "train": TRAIN, "batches": _batches(), "mesh": mesh}
    predicted = training_bytes_per_rank(MODEL, *mesh, weight_bytes=4, grad_bytes=4, state_bytes=8)
    for rank in run_ranks(bytes_held, 4, case, timeout_s=600, start_method="fork"):
        for kind, value in predicted.items():
            assert abs(rank[kind] - value) <= 0.05 * value, (kind, rank[kind], value)


# --- save_pretrained of a sharded model ----------------------------------------------------------------------

# four layers (three MoE) so that no output file holds most of the model; each model in a layout it can express
LINEAR = MODEL.replace(n_layers=4, residual="prenorm", ffn_activation="swiglu", mla_gated=False, latent_dim=None,
                       kda_output_gate="low_rank", kda_gate_bias=False, kda_lower_bound=None)
K3_RELEASED = MODEL.replace(n_layers=4, attnres_key_weight=True, latent_dim=32)  # MXFP4 packs groups of 32
SAVES = [(LINEAR, {"layout": "kimi_linear", "max_shard_bytes": 100_000}),
         (K3_RELEASED, {"layout": "kimi_k3", "mxfp4": True, "max_shard_bytes": 100_000})]


def _assert_same_folder(got: Path, want: Path) -> None:
    """The same files; every safetensors tensor torch.equal, config.json and the index equal."""
    assert sorted(path.name for path in got.iterdir()) == sorted(path.name for path in want.iterdir())
    for file in want.iterdir():
        if file.suffix == ".safetensors":
            mine, theirs = safetensors.torch.load_file(got / file.name), safetensors.torch.load_file(file)
            assert mine.keys() == theirs.keys(), file.name
            assert all(torch.equal(mine[name], theirs[name]) for name in theirs), file.name
        else:
            assert json.loads((got / file.name).read_text()) == json.loads(file.read_text()), file.name


def _largest_file_gathered(config: K3Config, state: dict, options: dict) -> int:
    """The bytes, as gathered (the model's float32), of the parts that make the largest output file."""
    parts = layout.checkpoint_layout(config)
    stored = torch.bfloat16 if options["layout"] == "kimi_k3" else None  # what the writer groups parts by
    plan = pretrained_save._shard_plan(pretrained_save._sizes(parts, state, stored), options["max_shard_bytes"])
    gathered = pretrained_save._sizes(parts, state)
    return max(sum(gathered[index] for index in members) for members in plan)


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4)], ids=lambda mesh: f"{mesh[0]}x{mesh[1]}")
def test_the_ranks_write_the_one_process_folder_gathering_tensor_by_tensor(mesh, tmp_path):
    """Every rank calls k3course.distributed.save_pretrained after a step on ``mesh``: rank 0 writes, in both
    layouts (kimi_k3 with MXFP4 experts), the folder that one process writes from the same weights (gathered),
    file for file and tensor for tensor; the gathered tensors it held at once never exceed the largest output
    file's, a fraction of the model; K3Model.save_pretrained refuses the sharded model, naming the collective."""
    case = {"train": TRAIN.replace(steps=1), "batches": _batches(), "mesh": mesh, "saves": SAVES,
            "out": str(tmp_path / "ranks")}
    rank0 = run_ranks(pretrained_folders, 4, case, timeout_s=600, start_method="fork")[0]
    for index, ((config, options), result) in enumerate(zip(SAVES, rank0, strict=True)):
        model = build_model(config, TRAIN.seed)
        model.load_state_dict(result["state"])
        want = model.save_pretrained(tmp_path / f"one-{index}", **options)
        assert len(list(want.glob("*.safetensors"))) > 2
        _assert_same_folder(tmp_path / "ranks" / str(index), want)
        _assert_same_folder(tmp_path / "ranks" / f"{index}-held", want)
        whole = sum(tensor.nbytes for tensor in result["state"].values())
        largest_file = _largest_file_gathered(config, result["state"], options)
        assert 0 < result["peak"] <= largest_file < whole / 2, (result["peak"], largest_file, whole)
        assert "k3course.distributed.save_pretrained" in result["refusal"]
        assert not (tmp_path / "ranks" / "refused").exists()


def test_save_pretrained_refuses_a_model_holding_a_block_of_experts(tmp_path):
    """Expert parallelism without FSDP leaves plain tensors, a block of each bank: no folder of part of a model."""
    model = build_model(K3_RELEASED, TRAIN.seed)
    keep_experts(model.moe_layers()[0].experts, 0, 4)
    with pytest.raises(ValueError, match=r"k3course\.distributed\.save_pretrained\(model, path, mesh\)"):
        model.save_pretrained(tmp_path / "folder", layout="kimi_k3")
    assert not (tmp_path / "folder").exists()
