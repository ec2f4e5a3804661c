"""`k3course bench gpu`: the one-command GPU check. On a CPU it must say what it skips and write nothing; its
every row is run here under the Triton interpreter at tiny shapes (timings meaningless, code paths real), so a
GPU session finds code that runs."""

from __future__ import annotations

import json

import pytest
import torch

from k3course.bench import gpu, kernels
from k3course.train import TrainConfig

SMOKE = kernels.Workload(seq_lens=(64,), heads=1, head_dim=16, decode_batches=(2,), gemm_tokens=16,
                         gemm_dims=(32, 16), gemm_experts=((4, 2),), breakdown_len=64, accuracy_len=64,
                         dtype=torch.float32, device="cpu")
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `k3course bench gpu` runs for real")


@needs_cpu
def test_without_a_gpu_it_says_what_it_skips_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "k3course bench gpu needs a CUDA GPU" in printed and "Nothing was written" in printed
    assert "fused_recurrent_kda" in printed and "torch._grouped_mm" in printed
    assert not out.exists()


def test_out_must_be_a_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--out", str(tmp_path)])
    assert "--out must be a file path" in capsys.readouterr().err


@needs_cpu
def test_every_row_runs_under_the_interpreter_and_round_trips(tmp_path, capsys):
    results = gpu.collect(SMOKE, "cpu (Triton interpreter)", run_tests=False,
                          train_step=TrainConfig(batch_size=1, seq_len=16), train_modes=("eager", "torch ops"))
    rows = results["rows"]
    cases = {row["case"] for row in rows}
    assert cases >= {"KDA forward T=64", "KDA fwd+bwd T=64", "KDA decode batch=2", "grouped GEMM E=4 top-2"}
    assert {case for case in cases if "step" in case} == {f"KDA fwd T=64 step {s}" for s in ("1", "2,6", "3,4",
                                                                                               "5,8", "7")}
    ours = [row for row in rows if row["impl"].startswith("ours") or "step" in row["case"]]
    assert len(ours) == len(cases) and all(row["ms"] > 0 for row in ours)  # our kernels all ran
    for row in rows:  # peers that ran are compared with ours; rates only where FLOPs were counted
        assert (row["vs_ours"] is not None) == (row["ms"] is not None and row not in ours)
        assert (row["tflops"] is None) == (row["ms"] is None or "step" in row["case"])
    assert results["accuracy"]["error_ratio"] < 1e-4  # fp32 kernel vs fp32 torch path
    assert results["workload"]["dtype"] == "float32" and results["tests"]["summary"].startswith("not run")
    saved = gpu.save(results, tmp_path / "gpu.json")
    assert not list(tmp_path.glob("*.partial"))
    capsys.readouterr()
    assert gpu.show_results(saved) == json.loads(saved.read_text())
    shown = capsys.readouterr().out
    assert "cpu (Triton interpreter)" in shown and "KDA decode batch=2" in shown and "peer ms / our ms" in shown
    steps = {(row["model"], row["mode"]) for row in results["train_step"]["rows"]}
    assert steps == {(model, mode) for model in ("tiny", "dense (tiny)", "small", "dense (small)")
                     for mode in ("eager", "torch ops")}
    assert "small: K3 / dense, eager" in shown and "tiny torch ops / eager" in shown


def test_show_results_without_a_file_says_how_to_make_one(tmp_path, capsys):
    assert gpu.show_results(tmp_path / "none.json") is None
    assert "run `k3course bench gpu` on a machine with a CUDA GPU" in capsys.readouterr().out


def test_save_replaces_a_file_whole(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text("old")
    gpu.save({"rows": [1]}, path)
    assert json.loads(path.read_text()) == {"rows": [1]} and [p.name for p in tmp_path.iterdir()] == ["gpu.json"]


def test_kernel_tests_run_in_a_fresh_process_and_report_pytest_summary():
    done = gpu.run_kernel_tests(files=("test_kernels_basics.py",), select="scale_add", timeout_s=240)
    assert done["returncode"] == 0 and "passed" in done["summary"] and "failed" not in done["summary"]
    missing = gpu.run_kernel_tests(files=("test_no_such_file.py",))
    assert missing["returncode"] is None and "not found" in missing["summary"]


def test_decode_accounting():
    flops, nbytes = kernels.decode_flops_bytes(batch=2, H=3, K=4, V=5, element=2)
    assert flops == 2 * 3 * 8 * 4 * 5
    assert nbytes == 2 * 3 * (2 * 4 * 5 * 4 + (3 * 4 + 2 * 5 + 1) * 2)  # fp32 state in and out, inputs, output
