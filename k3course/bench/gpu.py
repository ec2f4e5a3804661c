"""``k3course bench gpu``: is this GPU ready? The kernel tests and the GPU benchmarks, one command, < 5 minutes.

1. The Triton kernel tests (``tests/test_kernels*.py`` of a source checkout), compiled natively on the GPU, in a
   fresh process.
2. The KDA chunk kernel in bf16 against the fp32 torch chunked path (fla's error ratio; fla accepts ≤ 0.005).
3. The rows of ``k3course bench kernels`` on a short sweep: KDA chunk forward and forward + backward at
   T = 8192 (ours vs fla's ``chunk_kda`` vs the torch chunked path) with the kernel-by-kernel breakdown, the
   decode step at batch 1, 16 and 64 (vs fla's ``fused_recurrent_kda``), the MoE grouped GEMMs (vs
   ``torch._grouped_mm``); each with ms, TFLOP/s, % of the roofline and peer/ours (``--full``: all of
   ``bench kernels``' lengths).
4. The training step (``k3course bench train``): tiny and small K3 beside their dense baselines, eager (Triton
   kernels), eager with the torch ops instead, and compiled; ms per step, tokens/s and the ratios.
5. Everything saved to ``k3course/results/gpu.json`` (``--out`` elsewhere), written to a temporary name and
   renamed; lesson 08 shows the file with :func:`show_results`.

Without a CUDA GPU it says what it would run and exits 0, writing nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

from k3course.bench import add_options, apply_options, kernels
from k3course.bench import train as bench_train
from k3course.train import TrainConfig

RESULTS_FILE = Path(__file__).resolve().parents[1] / "results" / "gpu.json"
KERNEL_TESTS = ("test_kernels.py", "test_kernels_basics.py", "test_kernels_compile.py", "test_kernels_layers.py")
TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"  # present in a source checkout, not in a wheel
QUICK = kernels.Workload(seq_lens=(8192,))
BUDGET_S = 300
TRAIN_PRESETS = ("tiny", "small")  # the training-step rows: K3 presets beside their dense baselines
TRAIN_STEP = TrainConfig(batch_size=32, seq_len=512)  # the small preset's micro-batch (k3course train --preset small)


def run_kernel_tests(tests_dir: Path = TESTS_DIR, files: tuple[str, ...] = KERNEL_TESTS, timeout_s: float = 180,
                     select: str | None = None) -> dict:
    """pytest on ``files`` of ``tests_dir`` in a fresh process (so Triton picks its mode anew):
    {"command", "returncode", "summary" (pytest's last line), "seconds"}; "returncode" None when it timed out or
    the tests are not there (an installed wheel has none)."""
    paths = [tests_dir / name for name in files]
    missing = [str(path) for path in paths if not path.exists()]
    if missing:
        return {"command": None, "returncode": None, "seconds": 0.0,
                "summary": f"not run: {', '.join(missing)} not found (run from a source checkout)"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, paths)]
    command += ["-k", select] if select else []
    began = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=tests_dir.parent, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {"command": " ".join(command), "returncode": None, "seconds": time.perf_counter() - began,
                "summary": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"command": " ".join(command), "returncode": done.returncode, "seconds": time.perf_counter() - began,
            "summary": lines[-1] if lines else done.stderr.strip()[-300:]}


def _versions() -> dict:
    """torch, triton and fla versions ("not installed" where absent)."""
    found = {}
    for name in ("torch", "triton", "fla-core"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def collect(work: kernels.Workload, gpu: str, run_tests: bool = True, tests: dict | None = None,
            train_step: TrainConfig = TRAIN_STEP, train_modes: tuple[str, ...] = bench_train.MODES) -> dict:
    """Run the check and return the results: {"gpu", "versions", "workload", "tests", "accuracy", "rows",
    "train_step", "seconds"}. ``tests`` given (already run) skips running them here; ``train_step`` and
    ``train_modes``: the micro-batch and modes of the training-step rows (on ``work.device``)."""
    began = time.perf_counter()
    if tests is None:
        tests = run_kernel_tests() if run_tests else {"command": None, "returncode": None, "seconds": 0.0,
                                                      "summary": "not run (--no-tests)"}
    print(f"kernel tests: {tests['summary']}")
    ratio = kernels.check_bf16_accuracy(work)
    rows = kernels.benchmark_rows(work, gpu)
    kernels.print_rows(rows)
    training = bench_train.measure(list(TRAIN_PRESETS), train_step, list(train_modes), work.device, repeats=3,
                                   rounds=2)
    print(bench_train.report(training))
    workload = {field.name: getattr(work, field.name) for field in dataclasses.fields(work)}
    workload["dtype"] = str(work.dtype).removeprefix("torch.")
    return {"command": "k3course bench gpu", "gpu": gpu, "versions": _versions(), "workload": workload,
            "tests": tests, "accuracy": {"error_ratio": ratio, "tolerance": kernels.FLA_BF16_TOLERANCE,
                                         "seq_len": work.accuracy_len},
            "rows": rows, "train_step": training, "seconds": time.perf_counter() - began}


def save(results: dict, path: Path = RESULTS_FILE) -> Path:
    """Write ``results`` as JSON to a temporary name beside ``path``, then rename: a crash never leaves half a
    file where a good one was."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=1))
    partial.replace(path)
    return path


def show_results(path: Path = RESULTS_FILE) -> dict | None:
    """Print a saved ``k3course bench gpu`` result (the GPU, the tests, the accuracy, the table); returns it, or
    None with a note on how to make one when there is none."""
    import json

    if not path.exists():
        print(f"No GPU results saved yet: run `k3course bench gpu` on a machine with a CUDA GPU. It writes\n{path},"
              " which this cell then shows (nothing here is measured on a CPU).")
        return None
    results = json.loads(path.read_text())
    versions = ", ".join(f"{name} {version}" for name, version in results["versions"].items())
    print(f"{results['gpu']} ({versions}); the check took {results['seconds']:.0f} s")
    print(f"kernel tests: {results['tests']['summary']}")
    accuracy = results["accuracy"]
    print(f"KDA chunk kernel at T={accuracy['seq_len']}: error ratio {accuracy['error_ratio']:.2e} "
          f"(fla accepts ≤ {accuracy['tolerance']})")
    kernels.print_rows(results["rows"])
    if "train_step" in results:
        print(bench_train.report(results["train_step"]))
    return results


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS_FILE, help=f"results file (default {RESULTS_FILE})")
    parser.add_argument("--no-tests", action="store_true", help="benchmarks only, without the kernel tests")
    parser.add_argument("--full", action="store_true", help="every length of `bench kernels` (longer than 5 min)")
    add_options(parser, threads=0)
    args = parser.parse_args(options)
    if args.out.is_dir():
        parser.error(f"--out must be a file path, got the folder {args.out}")
    return args


def main(options: list[str]) -> int:
    args = _options(options)
    settings = apply_options(args.threads, args.return_freed_memory)
    if not torch.cuda.is_available():
        print(kernels.explain_cpu_skip("k3course bench gpu", QUICK.seq_lens)
              + "\nOn a GPU it also runs the kernel tests natively and saves every row to k3course/results/gpu.json."
              " Nothing was written.")
        return 0
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; roofline peaks (bf16 TFLOP/s, TB/s): {kernels.roofline_peaks_text(gpu)}; host: {settings}")
    results = collect(kernels.Workload() if args.full else QUICK, gpu, run_tests=not args.no_tests)
    print(f"saved {save(results, args.out)} ({results['seconds']:.0f} s"
          + (f", over the {BUDGET_S} s budget)" if results["seconds"] > BUDGET_S and not args.full else ")"))
    failed = results["tests"]["returncode"] not in (0, None)
    return 1 if failed else 0
