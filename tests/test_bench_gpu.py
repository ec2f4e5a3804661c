"""`k3course bench gpu`: the one-command GPU check. On a CPU it must say what it skips and write nothing; its
every row is run here under the Triton interpreter at tiny shapes (timings meaningless, code paths real), so a
GPU session finds code that runs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from k3course.bench import gpu, kernels

SMOKE = kernels.Workload(seq_lens=(64,), heads=1, head_dim=16, decode_batches=(2,), gemm_tokens=16,
                         gemm_dims=(32, 16), gemm_experts=((4, 2),), breakdown_len=64, accuracy_len=64,
                         dtype=torch.float32, device="cpu")
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `k3course bench gpu` runs for real")


@needs_cpu
def test_without_a_gpu_it_prints_its_plan_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "k3course bench gpu needs a CUDA GPU" in printed and "Nothing was written" in printed
    assert not out.exists()
    plan = [line.strip() for line in printed.splitlines() if line.strip()[:1].isdigit()]
    budgets = [float(line.split(" s ")[0]) for line in plan]
    assert all(budget > 0 for budget in budgets) and budgets[-1] == sum(budgets[:-1]) <= 480  # ≤ 8 minutes
    rows = "\n".join(plan)
    assert "test_kernels_backward.py" in rows and "test_grouped_gemm_backward.py" in rows
    assert "test_kernels_flash_mla.py" in rows
    for T in (4096, 8192):
        assert f"KDA fwd+bwd T={T}: ours vs fla chunk_kda" in rows
        assert f"MLA attention fwd+bwd T={T}: ours vs SDPA vs hand-written softmax" in rows
    assert "grouped GEMM fwd+bwd E=64 top-8: ours vs torch._grouped_mm" in rows and "fused_recurrent_kda" in rows
    assert "AttnRes depth read fwd+bwd T=8192: ours vs torch" in rows and "quantile histogram m=8192" in rows
    steps = [line for line in plan if "training step" in line]
    assert len(steps) == 2 * 2 * 2 * 2  # tiny and small, K3 and dense, T = 512 and 4096, eager and compiled
    for preset in ("tiny", "small"):
        for model in (preset, f"dense ({preset})"):
            for T, batch in ((512, 32), (4096, 4)):
                for mode in ("eager", "compiled"):
                    assert sum(f"step {model} T={T} ({batch} sequences), {mode}" in line for line in steps) == 1


def test_the_input_builders_give_the_gpu_shapes_and_dtypes_on_the_meta_device():
    work = dataclasses.replace(gpu.QUICK, device="meta")
    T = max(work.seq_lens)
    for tensor, last in zip(kernels.kda_inputs(work, T, requires_grad=True), (128, 128, 128, 128, None)):
        assert tensor.device.type == "meta" and tensor.dtype == torch.bfloat16 and tensor.requires_grad
        assert tensor.shape[:3] == (1, T, 16) and (last is None or tensor.shape[3] == last)
    q_nope, q_rope, k_nope, k_rope, values = gpu.attention_inputs(gpu.AttentionShape(), T, torch.bfloat16, "meta")
    assert (q_nope.shape, q_rope.shape, k_nope.shape, k_rope.shape, values.shape) == (
        (1, T, 16, 128), (1, T, 16, 64), (1, T, 16, 128), (1, T, 64), (1, T, 16, 128))
    assert {t.dtype for t in (q_nope, q_rope, k_nope, k_rope, values)} == {torch.bfloat16}
    for T in gpu.TRAIN_SEQ_LENS:  # the same bytes per step at every length
        train = gpu.step_config(T)
        assert train.seq_len == T and train.batch_size * T == gpu.TRAIN_TOKENS


def test_the_grouped_gemm_inputs_route_every_token_to_top_k_experts():
    work = dataclasses.replace(gpu.QUICK, gemm_tokens=24, gemm_dims=(16, 8), device="cpu")
    x, weights, ends = kernels.grouped_gemm_inputs(work, 6, 2, requires_grad=True)
    assert x.shape == (48, 16) and weights.shape == (6, 16, 8) and x.dtype == weights.dtype == torch.bfloat16
    assert ends.dtype == torch.int32 and ends.shape == (6,) and int(ends[-1]) == 48 and x.requires_grad


@needs_cpu
def test_every_piece_runs_under_the_interpreter_and_round_trips(tmp_path, capsys):
    shape = gpu.AttentionShape(batch=1, heads=2, nope=8, rope=4, value=8)
    pieces = gpu.plan(SMOKE, "cpu (Triton interpreter)", run_tests=False, attention=shape, train_seq_lens=(16,),
                      train_modes=("eager",), train_tokens=16)
    results = gpu.collect(pieces, SMOKE, "cpu (Triton interpreter)", budget_s=float("inf"))
    assert len(results["pieces"]) == len(pieces)  # every piece ran (on a CPU most over their GPU budgets)
    assert all(piece["status"].startswith("ran") and piece["seconds"] > 0 for piece in results["pieces"])
    rows = results["rows"]
    cases = {row["case"] for row in rows}
    assert cases >= {"KDA forward T=64", "KDA fwd+bwd T=64", "KDA decode batch=2", "grouped GEMM fwd+bwd E=4 top-2",
                     "MLA attention fwd+bwd T=64"}
    assert cases >= {"AttnRes depth read fwd+bwd T=64", "quantile histogram m=64 n=896"}  # K3's d and experts
    assert {case for case in cases if "step" in case} == {f"KDA fwd T=64 step {s}" for s in ("1", "2,6", "3,4",
                                                                                               "5,8", "7")}
    ours = [row for row in rows if row["impl"].startswith("ours") or "step" in row["case"]]
    assert len(ours) == len(cases) and all(row["ms"] > 0 for row in ours)  # our kernels all ran
    attention = [row for row in rows if row["case"] == "MLA attention fwd+bwd T=64"]
    assert [row["impl"] for row in attention] == ["ours (Triton flash_mla)", "SDPA (attend_sdpa)",
                                                  "hand-written softmax"]
    assert attention[1]["vs_ours"] > 0 and attention[2]["vs_ours"] > 0
    assert results["accuracy"]["error_ratio"] < 1e-4  # fp32 kernel vs fp32 torch path
    assert results["workload"]["dtype"] == "float32" and results["tests"]["summary"].startswith("not run")
    assert set(results["machine"]) >= {"gpu", "driver", "cuda", "torch", "triton"}
    steps = results["train_step"]["rows"]
    assert {(row["model"], row["seq_len"], row["batch"], row["mode"]) for row in steps} == {
        (model, 16, 1, "eager") for model in ("tiny", "dense (tiny)", "small", "dense (small)")}
    for row in steps:  # on a CPU the profiler sees host time and no kernels
        assert row["step_ms"] > 0 and row["host_ms"] > 0 and row["kernel_ms"] == 0 == row["kernels"]
    assert set(results["train_step"]["ratios"]) == {"tiny T=16 eager", "small T=16 eager"}
    saved = gpu.save(results, tmp_path / "gpu.json")
    assert not list(tmp_path.glob("*.partial"))
    capsys.readouterr()
    assert gpu.show_results(saved) == json.loads(saved.read_text())
    shown = capsys.readouterr().out
    assert "cpu (Triton interpreter)" in shown and "KDA decode batch=2" in shown and "peer ms / our ms" in shown
    assert "host ms" in shown and "K3 / dense, small T=16 eager" in shown


def test_a_piece_past_the_budget_is_not_started_and_a_failing_one_does_not_stop_the_rest(tmp_path, capsys):
    ran = []

    def broken():
        ran.append("broken")
        raise RuntimeError("no such kernel\nsecond line")

    pieces = [gpu.Piece("broken", "rows", 1.0, broken),
              gpu.Piece("first", "rows", 1.0, lambda: ran.append("first") or []),
              gpu.Piece("too long", "rows", 10.0, lambda: ran.append("too long") or [])]
    results = gpu.collect(pieces, SMOKE, "cpu", budget_s=5.0)
    assert ran == ["broken", "first"]
    assert [piece["status"] for piece in results["pieces"]] == [
        "failed: RuntimeError: no such kernel", "ran", "skipped: past the 5 s budget"]
    gpu.save(results, tmp_path / "gpu.json")
    capsys.readouterr()
    gpu.show_results(tmp_path / "gpu.json")
    shown = capsys.readouterr().out
    assert "failed: RuntimeError: no such kernel: broken" in shown and "skipped: past the 5 s budget: too long" in shown


def test_show_results_reads_a_file_saved_before_the_steps_were_profiled(tmp_path, capsys):
    old = {"gpu": "NVIDIA H200", "versions": {"torch": "2.11"}, "seconds": 200.0, "tests": {"summary": "9 passed"},
           "accuracy": {"seq_len": 2048, "error_ratio": 1e-3, "tolerance": 0.005}, "rows": [],
           "train_step": {"rows": [{"model": "tiny", "mode": "eager", "step_s": 0.1, "tokens_per_s": 1e5,
                                    "first_step_s": 2.0}], "ratios": {"tiny": {"K3 / dense, eager": 1.5}}}}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(old))
    assert gpu.show_results(path) == old
    shown = capsys.readouterr().out
    assert "NVIDIA H200 (torch 2.11)" in shown and "9 passed" in shown and "K3 / dense, eager 1.50x" in shown


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
