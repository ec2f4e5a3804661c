"""``k3course bench gpu``: is this GPU ready? The kernel tests and the GPU benchmarks, one command, ≤ 8 minutes.

The check is a plan of pieces, each with a time budget (:func:`plan`), run in order:

1. The native kernel tests (``tests/test_kernels*.py`` and ``tests/test_grouped_gemm_backward.py`` of a source
   checkout, backward kernels included), compiled on the GPU in a fresh process.
2. The KDA chunk kernel in bf16 against the fp32 torch chunked path (fla's error ratio; fla accepts ≤ 0.005).
3. KDA chunk forward at T = 8192 with the kernel-by-kernel breakdown, forward + backward at T = 4096 and 8192
   (ours vs fla's ``chunk_kda`` vs the torch chunked path), the decode step at batch 1, 16 and 64 (vs fla's
   ``fused_recurrent_kda``), the MoE grouped GEMM forward + backward (vs ``torch._grouped_mm``), and MLA's causal
   attention forward + backward, our Triton kernels (``k3course.kernels.flash_mla``) vs SDPA vs the hand-written
   softmax, Block AttnRes's depth read forward + backward and quantile balancing's margin histogram (Triton vs
   torch, at K3's width and expert count); each with ms, TFLOP/s, % of the roofline and peer/ours (``--full``:
   every length of ``bench kernels``).
4. Training steps: tiny and small K3 beside their dense baselines at T = 512 and 4096 (the same bytes per step),
   eager and compiled: ms per step, and from ``torch.profiler`` the host time, the kernel time, the kernels and
   launch calls, the host reads and syncs per step.
5. Everything saved with the machine (GPU, driver, torch, triton, fla) to ``k3course/results/gpu.json``
   (``--out`` elsewhere), written to a temporary name and renamed; lesson 08 shows it with :func:`show_results`.

A piece that would end past the budget is not started (it is saved as skipped). Without a CUDA GPU it prints the
plan, every row with its budget, and exits 0, writing nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

from k3course.bench import add_options, apply_options, kernels, profile_calls
from k3course.bench import train as bench_train
from k3course.config import K3Config
from k3course.device import best_seconds
from k3course.train import TrainConfig

RESULTS_FILE = Path(__file__).resolve().parents[1] / "results" / "gpu.json"
KERNEL_TESTS = ("test_kernels.py", "test_kernels_basics.py", "test_kernels_compile.py", "test_kernels_layers.py",
                "test_kernels_backward.py", "test_grouped_gemm_backward.py", "test_kernels_flash_mla.py")
TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"  # present in a source checkout, not in a wheel
QUICK = kernels.Workload(seq_lens=(4096, 8192))
BUDGET_S = 480  # the whole check on one H100/H200-class GPU
TRAIN_PRESETS = ("tiny", "small")  # the training-step rows: K3 presets beside their dense baselines
TRAIN_SEQ_LENS = (512, 4096)
TRAIN_TOKENS = 16384  # bytes per step at every length: 32 × 512, 4 × 4096
TRAIN_MODES = ("eager", "compiled")
# seconds each piece may take on the GPU (estimates; a compiled step includes its compilation)
PIECE_BUDGET_S = {"kernel tests": 120, "accuracy": 5, "KDA forward": 8, "KDA breakdown": 8, "KDA fwd+bwd": 11,
                  "KDA decode": 4, "grouped GEMM fwd+bwd": 10, "MLA attention fwd+bwd": 14, "step eager": 6,
                  "step compiled": 24,
                  "AttnRes depth read fwd+bwd": 4, "quantile histogram": 3}


@dataclasses.dataclass(frozen=True)
class Piece:
    """One row (or table) of the check: its name, the section of the results it fills ("tests", "accuracy",
    "rows", "train_step"), the seconds it may take, and the call that measures it."""

    name: str
    section: str
    budget_s: float
    run: Callable[[], object]


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """MLA's attention at one GPU's slice of K3: B sequences, H heads of NoPE width n, RoPE width e, value width v."""

    batch: int = 1
    heads: int = 16
    nope: int = 128
    rope: int = 64
    value: int = 128


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


def machine(gpu: str) -> dict:
    """The GPU's name, its driver, the CUDA runtime torch was built with, and the torch, triton and fla versions
    ("not installed" / "unknown" where absent)."""
    found = {"gpu": gpu, "driver": _driver_version(), "cuda": torch.version.cuda or "none"}
    for name in ("torch", "triton", "fla-core"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _driver_version() -> str:
    """The NVIDIA driver's version from ``nvidia-smi`` ("unknown" without it)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def attention_inputs(shape: AttentionShape, T: int, dtype: torch.dtype, device: str, requires_grad: bool = False):
    """Seeded MLA attention inputs in ``dtype``: q_nope [B, T, H, n], q_rope [B, T, H, e], k_nope [B, T, H, n],
    k_rope [B, T, e] (shared by the heads), values [B, T, H, v]."""
    B, H, gen = shape.batch, shape.heads, kernels.seeded(device, 3)

    def make(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, device=device, generator=gen).to(dtype).requires_grad_(requires_grad)

    return (make(B, T, H, shape.nope), make(B, T, H, shape.rope), make(B, T, H, shape.nope), make(B, T, shape.rope),
            make(B, T, H, shape.value))


def attention_rows(work: kernels.Workload, shape: AttentionShape, T: int, gpu: str) -> list[dict]:
    """MLA's causal attention (prefill, no cache) forward + backward at length T: ours, the FlashAttention-style
    Triton kernels (``flash_mla_attention``: the two-part head unpadded, the shared rope key read, not expanded),
    vs ``attend_sdpa`` (torch's fused kernels on a zero-padded head) vs ``attend_softmax`` (the [B, H, T, T] scores
    built and kept). FLOPs ≈ 3 × 2·B·H·(T²/2)·(n + e + v)."""
    from k3course.kernels.flash_mla import flash_mla_attention
    from k3course.layers.mla import attend_sdpa, attend_softmax

    inputs = attention_inputs(shape, T, work.dtype, work.device, requires_grad=True)
    scale = (shape.nope + shape.rope) ** -0.5
    flops = 3 * 2 * shape.batch * shape.heads * T * T / 2 * (shape.nope + shape.rope + shape.value)

    def call(attend):
        def run():
            attend(*inputs, scale).float().sum().backward()
        return run

    contenders = [("ours (Triton flash_mla)", call(flash_mla_attention)), ("SDPA (attend_sdpa)", call(attend_sdpa)),
                  ("hand-written softmax", call(attend_softmax))]
    return kernels.measure(f"MLA attention fwd+bwd T={T}", contenders, flops, None, gpu, work.device)


def depth_read_rows(work: kernels.Workload, T: int, gpu: str) -> list[dict]:
    """Block AttnRes's depth read forward + backward at K3's last read (N = 1 + ⌈2·93 / 24⌉ = 9 sources of width
    d = 7168) over T tokens: the one-pass Triton kernels vs the torch op. Bytes ≈ (4N + 2)·T·d elements (forward:
    the sources once, h out; backward: the sources twice, ∂h in, ∂sources out); FLOPs ≈ 22·N·T·d."""
    from k3course.kernels.depth_attention import depth_attention_triton
    from k3course.layers.residual import depth_attention

    cfg = K3Config.preset("kimi-k3")
    N, D, gen = 1 + -(-2 * cfg.n_layers // cfg.attnres_block_size), cfg.d_model, kernels.seeded(work.device, 4)
    sources = torch.randn(N, 1, T, D, device=work.device, generator=gen).to(work.dtype).requires_grad_()
    query = torch.randn(D, device=work.device, generator=gen).to(work.dtype).requires_grad_()

    def call(read):
        def run():
            read(query, sources)[0].float().sum().backward()
        return run

    element = torch.finfo(work.dtype).bits // 8
    contenders = [("ours (Triton, one pass)", call(depth_attention_triton)),
                  ("torch depth_attention", call(depth_attention))]
    return kernels.measure(f"AttnRes depth read fwd+bwd T={T}", contenders, 22 * N * T * D,
                           (4 * N + 2) * T * D * element, gpu, work.device)


def histogram_rows(work: kernels.Workload, tokens: int, gpu: str) -> list[dict]:
    """Quantile balancing's margin histogram of ``tokens`` tokens over K3's 896 experts into 256 bins: the Triton
    kernel (binary search, atomics) vs torch (bucketize + bincount). Timed for where the time goes (no FLOPs)."""
    from k3course.kernels.quantile_histogram import margin_histogram_triton
    from k3course.moe.balancing import HISTOGRAM_BINS, margin_histogram

    n = K3Config.preset("kimi-k3").n_routed_experts
    margins = torch.randn(tokens, n, device=work.device, dtype=torch.float64, generator=kernels.seeded(work.device, 5))
    edges = torch.linspace(-4.0, 4.0, HISTOGRAM_BINS + 1, dtype=torch.float64, device=work.device)
    contenders = [("ours (Triton, atomics)", functools.partial(margin_histogram_triton, margins, edges)),
                  ("torch bucketize + bincount", functools.partial(margin_histogram, margins, edges))]
    return kernels.measure(f"quantile histogram m={tokens} n={n}", contenders, None, None, gpu, work.device)


LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def step_profile(events: list, calls: int) -> dict:
    """Per step, from the profiler's events of ``calls`` steps: host_ms (CPU time in the outermost torch ops, every
    thread: the autograd engine's included, so it can exceed the step), kernel_ms (the GPU's activities: kernels,
    copies, fills), kernels (how many such activities), launch_calls (launch API calls: a CUDA graph's replay is
    one), host_reads (``aten::_local_scalar_dense``) and syncs (stream, device and event synchronisations)."""
    device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    outermost = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None]

    def per_step(names: tuple[str, ...]) -> float:
        return sum(e.name in names for e in events) / calls

    return {"host_ms": sum(e.cpu_time_total for e in outermost) / calls / 1e3,
            "kernel_ms": sum(e.time_range.elapsed_us() for e in device_events) / calls / 1e3,
            "kernels": len(device_events) / calls, "launch_calls": per_step(LAUNCH_CALLS),
            "host_reads": per_step(("aten::_local_scalar_dense",)), "syncs": per_step(SYNC_CALLS)}


def step_config(seq_len: int, tokens: int = TRAIN_TOKENS) -> TrainConfig:
    """The training-step rows' micro-batch at ``seq_len``: ⌊tokens / seq_len⌋ sequences (at least one)."""
    return TrainConfig(batch_size=max(1, tokens // seq_len), seq_len=seq_len)


def train_step_row(name: str, cfg: K3Config, train: TrainConfig, mode: str, device: str, repeats: int = 3) -> dict:
    """One training step of ``cfg`` (``k3course bench train``'s step: forward, backward, clipping, AdamW, bias
    update) in ``mode``: {"model", "mode", "seq_len", "batch", "step_ms" (best of ``repeats``), "first_step_s"
    (a compiled step's compilation included), and :func:`step_profile` over ``repeats`` profiled steps}."""
    step, first = bench_train.step_function(cfg, train, mode, device)
    step_ms = best_seconds(step, repeats, device) * 1e3
    events, _ = profile_calls(step, repeats, device)
    return {"model": name, "mode": mode, "seq_len": train.seq_len, "batch": train.batch_size, "step_ms": step_ms,
            "first_step_s": first, **step_profile(events, repeats)}


def kernel_pieces(work: kernels.Workload, gpu: str, attention: AttentionShape) -> list[Piece]:
    """The kernel rows, each a piece: KDA forward and fwd+bwd at each length, the breakdown, decode, grouped GEMM
    fwd+bwd, MLA attention fwd+bwd; at the longest length the depth read fwd+bwd and the margin histogram."""

    def row(name: str, kind: str, fn: Callable, *args) -> Piece:
        return Piece(name, "rows", PIECE_BUDGET_S[kind], functools.partial(fn, work, *args))

    fla = "ours vs fla chunk_kda vs torch chunked"
    pieces = [row(f"KDA forward T={T}: {fla}", "KDA forward", kernels.kda_rows, T, gpu, False) for T in work.seq_lens]
    if work.breakdown_len:
        pieces.append(row(f"KDA forward T={work.breakdown_len}, kernel by kernel", "KDA breakdown",
                          kernels.breakdown_rows, work.breakdown_len, gpu))
    pieces += [row(f"KDA fwd+bwd T={T}: {fla}", "KDA fwd+bwd", kernels.kda_rows, T, gpu, True) for T in work.seq_lens]
    pieces += [row(f"KDA decode batch={batch}: ours vs fla fused_recurrent_kda vs torch step", "KDA decode",
                   kernels.decode_rows, batch, gpu) for batch in work.decode_batches]
    pieces += [row(f"grouped GEMM fwd+bwd E={E} top-{k}: ours vs torch._grouped_mm vs per-expert loop",
                   "grouped GEMM fwd+bwd", kernels.grouped_gemm_rows, E, k, gpu, True) for E, k in work.gemm_experts]
    pieces += [row(f"MLA attention fwd+bwd T={T}: ours vs SDPA vs hand-written softmax", "MLA attention fwd+bwd",
                   attention_rows, attention, T, gpu) for T in work.seq_lens]
    T = max(work.seq_lens)
    pieces.append(row(f"AttnRes depth read fwd+bwd T={T}: ours vs torch", "AttnRes depth read fwd+bwd",
                      depth_read_rows, T, gpu))
    pieces.append(row(f"quantile histogram m={T}: ours vs torch bucketize", "quantile histogram", histogram_rows, T,
                      gpu))
    return pieces


def train_pieces(presets: tuple[str, ...], seq_lens: tuple[int, ...], modes: tuple[str, ...], tokens: int,
                 device: str) -> list[Piece]:
    """A training-step piece for each K3 preset and its dense baseline, length and mode (eager ones first)."""
    models = [(name, cfg) for preset in presets for name, cfg in bench_train.variants(K3Config.preset(preset)).items()]
    return [Piece(f"training step {name} T={T} ({step_config(T, tokens).batch_size} sequences), {mode}", "train_step",
                  PIECE_BUDGET_S.get(f"step {mode}", PIECE_BUDGET_S["step eager"]),
                  functools.partial(train_step_row, name, cfg, step_config(T, tokens), mode, device))
            for mode in modes for name, cfg in models for T in seq_lens]


def plan(work: kernels.Workload, gpu: str, run_tests: bool = True, attention: AttentionShape = AttentionShape(),
         train_presets: tuple[str, ...] = TRAIN_PRESETS, train_seq_lens: tuple[int, ...] = TRAIN_SEQ_LENS,
         train_modes: tuple[str, ...] = TRAIN_MODES, train_tokens: int = TRAIN_TOKENS) -> list[Piece]:
    """Every piece of the check, in the order it runs: the kernel tests, the bf16 accuracy, the kernel rows, the
    training steps. Building the plan runs nothing."""
    accuracy = functools.partial(_accuracy, work)
    pieces = [Piece("native kernel tests: " + ", ".join(KERNEL_TESTS), "tests", PIECE_BUDGET_S["kernel tests"],
                    functools.partial(run_kernel_tests, timeout_s=PIECE_BUDGET_S["kernel tests"]))] if run_tests else []
    pieces.append(Piece(f"KDA chunk kernel in {str(work.dtype).removeprefix('torch.')} vs fp32 at "
                        f"T={work.accuracy_len}", "accuracy", PIECE_BUDGET_S["accuracy"], accuracy))
    return pieces + kernel_pieces(work, gpu, attention) + train_pieces(train_presets, train_seq_lens, train_modes,
                                                                       train_tokens, work.device)


def _accuracy(work: kernels.Workload) -> dict:
    return {"error_ratio": kernels.check_bf16_accuracy(work), "tolerance": kernels.FLA_BF16_TOLERANCE,
            "seq_len": work.accuracy_len}


def print_plan(pieces: list[Piece], budget_s: float = BUDGET_S) -> None:
    """Each piece with its budget, and their total against ``budget_s``."""
    for piece in pieces:
        print(f"  {piece.budget_s:5.0f} s  {piece.name}")
    print(f"  {sum(piece.budget_s for piece in pieces):5.0f} s  in all (budget {budget_s:.0f} s)")


def collect(pieces: list[Piece], work: kernels.Workload, gpu: str, budget_s: float = BUDGET_S) -> dict:
    """Run ``pieces`` in order and return the results: {"command", "gpu", "machine", "versions", "workload",
    "tests", "accuracy", "rows", "train_step": {"rows", "ratios"}, "pieces", "seconds"}. A piece whose budget
    would end past ``budget_s`` is not started; one that raises is recorded as failed (with the error) and the
    rest still run; "pieces" says of each: its budget, the seconds it took, and "ran" or why not."""
    began = time.perf_counter()
    found = machine(gpu)
    workload = {field.name: getattr(work, field.name) for field in dataclasses.fields(work)}
    workload["dtype"] = str(work.dtype).removeprefix("torch.")
    results = {"command": "k3course bench gpu", "gpu": gpu, "machine": found,
               "versions": {name: found[name] for name in ("torch", "triton", "fla-core")}, "workload": workload,
               "tests": {"command": None, "returncode": None, "seconds": 0.0, "summary": "not run"},
               "accuracy": None, "rows": [], "train_step": {"rows": []}, "pieces": []}
    for piece in pieces:
        record = {"name": piece.name, "budget_s": piece.budget_s}
        if time.perf_counter() - began + piece.budget_s > budget_s:
            results["pieces"].append(record | {"seconds": None, "status": f"skipped: past the {budget_s:.0f} s budget"})
            continue
        started = time.perf_counter()
        try:
            _file(results, piece, piece.run())
            status = "ran"
        except Exception as error:  # one broken row must not lose the others' numbers: said, saved, exit code 1
            status = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            print(f"{piece.name}: {status}")
        seconds = time.perf_counter() - started
        over = ", over its budget" if seconds > piece.budget_s and status == "ran" else ""
        results["pieces"].append(record | {"seconds": seconds, "status": status + over})
    results["train_step"]["ratios"] = step_ratios(results["train_step"]["rows"])
    results["seconds"] = time.perf_counter() - began
    return results


def _file(results: dict, piece: Piece, out) -> None:
    """Put one piece's output where it belongs in ``results`` and print it."""
    if piece.section == "rows":
        results["rows"] += out
        kernels.print_rows(out)
    elif piece.section == "train_step":
        results["train_step"]["rows"].append(out)
        print(train_report({"rows": [out], "ratios": {}}).splitlines()[-1])
    else:
        results[piece.section] = out
        print(f"{piece.name}: {out['summary'] if piece.section == 'tests' else out}")


def step_ratios(rows: list[dict]) -> dict:
    """K3 / dense ms per step for every (preset, T, mode) where both ran: {"tiny T=512 eager": ratio, ...}."""
    ms = {(row["model"], row["seq_len"], row["mode"]): row["step_ms"] for row in rows}
    return {f"{model} T={T} {mode}": value / ms[(f"dense ({model})", T, mode)]
            for (model, T, mode), value in ms.items() if (f"dense ({model})", T, mode) in ms}


# the training-step table: (header, the row's key, its format)
STEP_COLUMNS = (("model", "model", "<14"), ("T", "seq_len", ">5"), ("mode", "mode", "<9"),
                ("ms/step", "step_ms", "8.1f"), ("host ms", "host_ms", "8.1f"), ("kernel ms", "kernel_ms", "9.1f"),
                ("kernels", "kernels", "8.0f"), ("launches", "launch_calls", "8.0f"), ("reads", "host_reads", "6.0f"),
                ("syncs", "syncs", "6.0f"), ("first s", "first_step_s", "7.1f"))


def train_report(train_step: dict) -> str:
    """The training-step rows as a table (:data:`STEP_COLUMNS`: ms per step, host and kernel ms, kernels, launch
    calls, host reads and syncs per step, the first step's seconds) and K3 / dense for each preset, length, mode."""
    lines = [" ".join(f"{header:{'<' if spec[0] == '<' else '>'}{spec.lstrip('<>').split('.')[0]}}"
                      for header, _, spec in STEP_COLUMNS)]
    lines += [" ".join(f"{row[key]:{spec}}" for _, key, spec in STEP_COLUMNS) for row in train_step["rows"]]
    lines += [f"K3 / dense, {case}: {ratio:.2f}x" for case, ratio in train_step.get("ratios", {}).items()]
    return "\n".join(lines)


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
    """Print a saved ``k3course bench gpu`` result (the machine, the tests, the accuracy, the kernel table, the
    training steps, the pieces skipped); returns it, or None with a note on how to make one when there is none.
    Files saved before the training steps were profiled (their "train_step" in ``bench train``'s form) read too."""
    import json

    if not path.exists():
        print(f"No GPU results saved yet: run `k3course bench gpu` on a machine with a CUDA GPU. It writes\n{path},"
              " which this cell then shows (nothing here is measured on a CPU).")
        return None
    results = json.loads(path.read_text())
    versions = ", ".join(f"{name} {version}" for name, version in results["versions"].items())
    driver = f"driver {results['machine']['driver']}, " if "machine" in results else ""
    print(f"{results['gpu']} ({driver}{versions}); the check took {results['seconds']:.0f} s")
    print(f"kernel tests: {results['tests']['summary']}")
    accuracy = results["accuracy"]
    if accuracy:
        print(f"KDA chunk kernel at T={accuracy['seq_len']}: error ratio {accuracy['error_ratio']:.2e} "
              f"(fla accepts ≤ {accuracy['tolerance']})")
    kernels.print_rows(results["rows"])
    steps = results.get("train_step", {"rows": []})
    if steps["rows"]:
        print(train_report(steps) if "host_ms" in steps["rows"][0] else bench_train.report(steps))
    for piece in results.get("pieces", []):
        if not piece["status"].startswith("ran"):
            print(f"{piece['status']}: {piece['name']}")
    return results


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS_FILE, help=f"results file (default {RESULTS_FILE})")
    parser.add_argument("--no-tests", action="store_true", help="benchmarks only, without the kernel tests")
    parser.add_argument("--full", action="store_true", help="every length of `bench kernels` (no time budget)")
    add_options(parser, threads=0)
    args = parser.parse_args(options)
    if args.out.is_dir():
        parser.error(f"--out must be a file path, got the folder {args.out}")
    return args


def main(options: list[str]) -> int:
    args = _options(options)
    settings = apply_options(args.threads, args.return_freed_memory)
    work = kernels.Workload() if args.full else QUICK
    budget_s = float("inf") if args.full else BUDGET_S
    if not torch.cuda.is_available():
        print("k3course bench gpu needs a CUDA GPU: on a CPU the Triton kernels run under the interpreter, thousands "
              "of times slower than torch (see lesson 08),\nso nothing here would be measured. On a GPU it runs, in "
              "order (seconds each may take):")
        print_plan(plan(work, "cpu", run_tests=not args.no_tests), budget_s)
        print(f"and saves every row with the machine to {args.out}. Nothing was written.")
        return 0
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; roofline peaks (bf16 TFLOP/s, TB/s): {kernels.roofline_peaks_text(gpu)}; host: {settings}")
    results = collect(plan(work, gpu, run_tests=not args.no_tests), work, gpu, budget_s)
    print(train_report(results["train_step"]))
    print(f"saved {save(results, args.out)} ({results['seconds']:.0f} s of the {budget_s:.0f} s budget)")
    failed = [piece for piece in results["pieces"] if piece["status"].startswith("failed")]
    return 1 if failed or results["tests"]["returncode"] not in (0, None) else 0
