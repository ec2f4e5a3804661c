"""The ``k3course`` command: doctor, build-exercises, progress, bench, train, generate, experiments."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path


def _build_exercises(args) -> int:
    from k3course.grading.build import MarkerError, build

    try:
        problems = build(Path(args.root), check_only=args.check)
    except MarkerError as error:
        print(f"unbalanced solution markers: {error}", file=sys.stderr)
        return 2
    except FileNotFoundError as error:
        print(error, file=sys.stderr)
        return 2
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{len(problems)} exercise notebook(s) out of sync with solutions/: run `k3course build-exercises`",
              file=sys.stderr)
        return 1
    print("exercises/ is in sync with solutions/" if args.check else "exercises/ rebuilt from solutions/")
    return 0


def _progress(args) -> int:
    from tqdm import tqdm

    from k3course.grading.notebooks import execute

    folder = Path(args.folder)
    paths = sorted(folder.glob("[0-9][0-9]_*.ipynb")) if folder.is_dir() else [folder]
    if not paths or not paths[0].exists():
        print(f"folder: no exercise notebooks at {folder}", file=sys.stderr)
        return 2
    rows, reasons = [], []
    for path in tqdm(paths, desc="running notebooks", unit="nb"):
        _, results = execute(path)
        rows += [(path.name, exercise_id, cell.status) for cell in results for exercise_id in cell.exercise_ids]
        reasons += [(path.name, ", ".join(cell.exercise_ids), number, cell) for number, cell in enumerate(results, 1)
                    if cell.status == "failing" and cell.exercise_ids]
    width = max([len("exercise"), *(len(r[1]) for r in rows)])
    print(f"{'notebook':<28} {'exercise':<{width}}  status")
    for name, exercise_id, status in rows:
        print(f"{name:<28} {exercise_id:<{width}}  {status}")
    done = sum(status == "done" for *_, status in rows)
    print(f"{done} of {len(rows)} exercises done")
    if reasons:
        print("\nwhy each failing one fails ([n]: the code cell's number in JupyterLab after Restart and Run All):")
        for name, exercise_ids, number, cell in reasons:
            lines = (cell.error_value or "").strip().splitlines() or [""]
            print(f"  {name} {exercise_ids} [{number}]: {cell.error_name}: {lines[0]}")
            for line in lines[1:3]:
                print(f"      {line}")
        print(f"the full report of one: pytest --nbval --nbval-current-env --nbval-cell-timeout=120 "
              f"{folder / reasons[0][0] if folder.is_dir() else folder}")
    return 0


def _bench(args) -> int:
    from k3course import bench

    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__))
    if args.name not in names:
        print(f"name: unknown benchmark {args.name!r}; choose one of {', '.join(names)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"k3course.bench.{args.name}").main(args.options) or 0


def _train(args) -> int:
    from k3course.checkpoint import CheckpointError
    from k3course.train import train_command

    if args.ep > 1:
        return _train_expert_parallel(args)
    try:
        summary = train_command(args.preset, args.steps, args.out, args.resume, args.device)
    except (ValueError, OSError, CheckpointError) as error:
        print(error, file=sys.stderr)
        return 2
    trigram = summary["baselines"]["trigram"]
    print(f"step {summary['step']}: validation {summary['val_bpb']:.3f} bits/byte (byte trigram {trigram:.3f}) "
          f"in {summary['seconds'] / 60:.1f} min; checkpoints, metrics.jsonl and loss.png in {summary['out']}")
    return 0


def _train_expert_parallel(args) -> int:
    from k3course.train import train_expert_parallel

    if args.resume or args.device != "cpu":
        print("--ep runs P local gloo processes on the CPU from scratch (no --resume, no --device; on GPUs use "
              "torchrun --standalone -m k3course.train)", file=sys.stderr)
        return 2
    try:
        summary = train_expert_parallel(args.preset, args.ep, args.steps, args.out)
    except (ValueError, OSError) as error:
        print(error, file=sys.stderr)
        return 2
    print(f"step {summary['step']} on {args.ep} expert-parallel ranks: loss {summary['loss']:.4f}; "
          f"one-process checkpoint and metrics.jsonl in {summary['out']}")
    return 0


def _generate(args) -> int:
    from k3course.checkpoint import CheckpointError
    from k3course.train import generate_command

    try:
        text = generate_command(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                                args.seed)
    except (ValueError, CheckpointError) as error:
        print(error, file=sys.stderr)
        return 2
    print(text)
    return 0


def _experiment_names() -> list[str]:
    from k3course.lessons.experiments import EXPERIMENTS

    return list(EXPERIMENTS)


def _experiments(args) -> int:
    from k3course.lessons.experiments import main as experiments_main

    return experiments_main([args.name, "--jobs", str(args.jobs)])


def _doctor(args) -> int:
    from k3course.doctor import main as doctor_main

    return doctor_main()


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="k3course", description="Rebuild Kimi K3 from NumPy to Triton.")
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="environment check: versions, device, Triton mode, oracle").set_defaults(
        run=_doctor)
    build = sub.add_parser("build-exercises", help="generate exercises/ from solutions/")
    build.add_argument("--check", action="store_true", help="only check that exercises/ is up to date")
    build.add_argument("--root", default=".", help="repository root holding solutions/ and exercises/")
    build.set_defaults(run=_build_exercises)
    progress = sub.add_parser("progress", help="run exercise notebooks and tabulate done / not done / failing")
    progress.add_argument("folder", nargs="?", default="exercises")
    progress.set_defaults(run=_progress)
    bench = sub.add_parser("bench", help="benchmarks, printed as ratios measured in one run")
    bench.add_argument("name", help="which benchmark (moe, kda, kernels, ...)")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(run=_bench)
    train = sub.add_parser("train", help="train a K3 preset on the standard library's source bytes")
    train.add_argument("--preset", default="tiny", help="training preset: tiny (CPU, ≤ 10 min) or small (one GPU)")
    train.add_argument("--steps", type=int, default=None, help="total optimizer steps of the run")
    train.add_argument("--out", default=None, help="run folder for checkpoints and metrics (default runs/PRESET)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    train.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    train.add_argument("--ep", type=int, default=1, help="expert-parallel ranks: spawn P local gloo processes")
    train.set_defaults(run=_train)
    generate = sub.add_parser("generate", help="continue a prompt with a trained checkpoint")
    generate.add_argument("--checkpoint", required=True, help="a step-NNNNNN folder, or a run folder (latest)")
    generate.add_argument("--prompt", default="def ", help="text to continue (UTF-8)")
    generate.add_argument("--max-new-tokens", type=int, default=200, help="bytes to generate")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    generate.add_argument("--top-k", type=int, default=None, help="sample among the k most likely bytes")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
    generate.set_defaults(run=_generate)
    experiments = sub.add_parser("experiments", help="re-run a saved experiment of chapter 12 (results as JSON)")
    experiments.add_argument("name", help="which experiment: " + ", ".join(_experiment_names()))
    experiments.add_argument("--jobs", type=int, default=1,
                             help="claim experiments: runs trained at a time, each in its own process")
    experiments.set_defaults(run=_experiments)
    return top


TRAINING_COMMANDS = ("train", "experiments")  # long runs whose steps allocate the same temporaries again and again


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command in TRAINING_COMMANDS:
        from k3course.device import keep_freed_memory

        keep_freed_memory()  # reuse freed memory instead of faulting it in anew every step
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
