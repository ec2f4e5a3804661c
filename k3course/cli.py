"""The ``k3course`` command: doctor, build-exercises, progress, bench, train, generate, eval, runs, experiments."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import unicodedata
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

    from k3course.grading.notebooks import execute, first_error_position
    from k3course.grading.progress import progress_table, run_all_label

    folder = Path(args.folder)
    paths = sorted(folder.glob("[0-9][0-9]_*.ipynb")) if folder.is_dir() else [folder]
    if not paths or not paths[0].exists():
        print(f"folder: no exercise notebooks at {folder}", file=sys.stderr)
        return 2
    rows, reasons = [], []
    for path in tqdm(paths, desc="running notebooks", unit="nb"):
        _, results = execute(path)
        stopped_at = first_error_position(results)
        rows += [(path.name, exercise_id, cell.status) for cell in results for exercise_id in cell.exercise_ids]
        reasons += [(path.name, ", ".join(cell.exercise_ids), run_all_label(number, stopped_at), cell)
                    for number, cell in enumerate(results, 1) if cell.status == "failing" and cell.exercise_ids]
    print("\n".join(progress_table(rows)))
    done = sum(status == "done" for *_, status in rows)
    print(f"{done} of {len(rows)} exercises done")
    if reasons:
        print("\nwhy each failing one fails ([n]: the code cell's number in JupyterLab after Restart and Run All, "
              "which stops at the first error):")
        for name, exercise_ids, label, cell in reasons:
            lines = (cell.error_value or "").strip().splitlines() or [""]
            print(f"  {name} {exercise_ids} {label}: {cell.error_name}: {lines[0]}")
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


def _set_threads(args) -> None:
    """``--threads N``: torch's CPU threads for this process (left alone when not given)."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def _train_flags(args) -> list[tuple[str, str, object]]:
    """The shorthand options as (flag, section.field, value), applied after --config and before --set."""
    flags = [("--steps", "train.steps", args.steps), ("--seed", "train.seed", args.seed),
             ("--data", "run.data", args.data and tuple(args.data)), ("--val", "run.val", args.val and tuple(args.val)),
             ("--dtype", "run.dtype", args.dtype), ("--kernels", "run.kernels", args.kernels)]
    return [flag for flag in flags if flag[2] is not None]


def _train(args) -> int:
    import time

    from k3course import checkpoint, data
    from k3course.checkpoint import CheckpointError
    from k3course.train import TrainingInterrupted, train
    from k3course.train.config import run_corpus
    from k3course.train.launch import configure, warmup_warning

    _set_threads(args)
    ranks = args.dp_shard * args.ep
    if ranks > 1 and args.compile:
        print(f"--compile: compiles a one-process run; leave it out with {ranks} ranks (--dp-shard × --ep)",
              file=sys.stderr)
        return 2
    try:
        config, out, resume, saved = configure(args.preset, args.out, args.config, _train_flags(args), args.set,
                                               args.resume, args.extend_to)
        if args.print_config:
            print(config.toml(), end="")
            return 0
        short = warmup_warning(config.train)
        if short is not None:
            print(short)
        if args.extend_to is not None:
            print(f"extending {out} from step {saved.step} to {args.extend_to}: a new schedule tail (from here the "
                  f"learning rate follows the warmup + cosine of a {args.extend_to}-step run); not the same as a "
                  f"straight {args.extend_to}-step run")
        began = time.perf_counter()
        train(config, out, resume, ranks=ranks, dp_shard=args.dp_shard, device=args.device, compile=args.compile)
    except TrainingInterrupted as stopped:
        print(stopped, file=sys.stderr)
        return 128 + stopped.signum
    except (ValueError, OSError, CheckpointError) as error:
        print(error, file=sys.stderr)
        return 2
    final = checkpoint.read_metrics(out)[-1]
    if args.resume and saved.step == final["step"]:
        print(f"{out} is finished (step {final['step']}): nothing to resume; --extend-to N trains it further")
        return 0
    trigram = data.baselines(run_corpus(config.run))["trigram"]
    layout = "" if ranks == 1 else f" on {args.ep} expert-parallel ranks" if args.dp_shard == 1 else \
        f" on {ranks} ranks ({args.dp_shard} × {args.ep}, FSDP2 × EP)"
    print(f"step {final['step']}{layout}: validation {final['val_bpb']:.3f} bits/byte (byte trigram {trigram:.3f}) "
          f"in {(time.perf_counter() - began) / 60:.1f} min; checkpoints, metrics.jsonl and loss.png in {out}")
    return 0


def _generate(args) -> int:
    from k3course.train.generate import generate_command

    _set_threads(args)
    if args.pretrained is not None:
        import torch

        from k3course.pretrained_generation import pretrained_text

        pieces = pretrained_text(args.pretrained, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                                 args.seed, args.device, getattr(torch, args.dtype), args.trust_remote_code)
    else:
        pieces = generate_command(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                                  args.seed)
    if not args.stream:
        print(terminal_safe("".join(pieces)))
        return 0
    for piece in pieces:
        sys.stdout.write(terminal_safe(piece))
        sys.stdout.flush()
    print()
    return 0


def terminal_safe(text: str) -> str:
    """``text`` with every control character (Unicode category Cc: C0, DEL, C1) other than newline and tab written
    as its escape ``\\xNN``, so a model's output cannot move the cursor, recolour or ring the terminal."""
    return "".join(f"\\x{ord(char):02x}" if unicodedata.category(char) == "Cc" and char not in "\n\t" else char
                   for char in text)


def _eval(args) -> int:
    from k3course.runs import eval_report, evaluate_checkpoint

    _set_threads(args)
    print(eval_report(evaluate_checkpoint(args.checkpoint, args.data or (), args.eval_bytes, args.device)))
    return 0


def _runs(args) -> int:
    from k3course.runs import compare_runs, runs_table

    rows, plot = compare_runs(args.runs, args.plot)
    print(runs_table(rows))
    print(f"validation curves: {plot}")
    return 0


def _experiment_names() -> list[str]:
    from k3course.lessons.experiments import EXPERIMENTS

    return list(EXPERIMENTS)


def _experiment_budgets() -> tuple[str, ...]:
    from k3course.lessons.experiments import BUDGETS

    return BUDGETS


def _experiments(args) -> int:
    from k3course.lessons.experiments import main as experiments_main

    device = ["--device", args.device] if args.device else []
    return experiments_main([args.name, "--jobs", str(args.jobs), "--budget", args.budget, *device])


def _doctor(args) -> int:
    from k3course.doctor import main as doctor_main

    return doctor_main()


def _positive_int(text: str) -> int:
    """argparse type of the options that count something (threads, steps to extend to, bytes): an int ≥ 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int ≥ 1, got {value}")
    return value


TRAIN_EPILOG = """order: the preset, then --config, then --steps/--seed/--data/--val/--dtype/--kernels, then --set
(later wins).
--resume continues an interrupted run exactly (Ctrl-C or SIGTERM writes a checkpoint at the next step and prints
the command); --extend-to N trains a finished or interrupted run on to step N on a new schedule tail (not the
same as a straight N-step run). Every field of the three tables, with the tiny preset's values:

"""


def _add_train(sub) -> None:
    """``k3course train`` and its options; the help lists each option's default and every config field."""
    from k3course.kernels import BACKENDS
    from k3course.train import RunConfig
    from k3course.train.config import train_preset

    fields = RunConfig(*train_preset("tiny")).toml().split("\n", 2)[2]
    train = sub.add_parser("train", help="train a K3 on the stdlib's source bytes or on your own text",
                           epilog=TRAIN_EPILOG + fields, formatter_class=argparse.RawDescriptionHelpFormatter)
    option = train.add_argument
    option("--preset", default=None, help="training preset: tiny (CPU, ≤ 10 min) or small (one GPU) "
                                          "(default: the config file's preset, else tiny)")
    option("--config", default=None, metavar="TOML", help="a run config: preset = ..., [model], [train], [run] "
                                                          "(default: none)")
    option("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
           help="override any field: model.d_model=64, train.lr=1e-3, run.dtype=bfloat16 (section optional when "
                "the name is unique; default: none)")
    option("--steps", type=int, default=None, help="total optimizer steps of the run (default: the preset's)")
    option("--data", nargs="+", default=None, metavar="PATH",
           help="your text: files, folders, globs, split by file hash (default: the stdlib's .py files)")
    option("--val", nargs="+", default=None, metavar="PATH",
           help="validation files for --data, instead of the hash split (default: none)")
    option("--dtype", choices=("float32", "bfloat16"), default=None,
           help="bfloat16: autocast forward, fp32 weights and KDA states (default: float32)")
    option("--kernels", choices=BACKENDS, default=None,
           help="the model's kernel backend, saved with the run (default: $K3COURSE_KERNELS, else auto)")
    option("--seed", type=int, default=None, help="initialisation and batch seed (default: the preset's, 0)")
    option("--out", default=None, help="run folder for checkpoints and metrics (default: runs/PRESET)")
    option("--resume", action="store_true", help="continue the interrupted run in --out exactly (default: off)")
    option("--extend-to", type=_positive_int, default=None, metavar="N",
           help="train the run in --out on to step N: a new schedule tail (default: none)")
    option("--print-config", action="store_true", help="print the resolved config as TOML and stop (default: off)")
    option("--device", default="cpu", help="torch device: cpu, cuda (default: cpu)")
    option("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    option("--compile", action="store_true", help="torch.compile the model: the first step compiles (minutes on a "
                                                  "CPU), later steps run the compiled graphs (default: off)")
    option("--ep", type=_positive_int, default=1, help="expert-parallel ranks: spawn P local processes, gloo on the "
                                                       "CPU, NCCL for --device cuda, the routed experts split over "
                                                       "them, every other weight sharded (default: 1)")
    option("--dp-shard", type=_positive_int, default=1, metavar="N",
           help="FSDP2 × EP: spawn N × P ranks on a mesh of N × P (\"dp_shard\", \"ep\"), every weight sharded, "
                "each expert block over N; any run of several ranks writes sharded (DCP) checkpoints (default: 1)")
    train.set_defaults(run=_train)


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
    _add_train(sub)
    generate = sub.add_parser("generate", help="continue a prompt with a trained checkpoint or a pretrained model")
    which = generate.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a step-NNNNNN folder, or a run folder (latest)")
    which.add_argument("--pretrained", metavar="PATH", help="a Kimi Linear / DeepSeek-V3 checkpoint folder in "
                       "transformers' layout or a Kimi K3 one in its released layout, run by "
                       "K3Model.from_pretrained with its own tokenizer (no download)")
    generate.add_argument("--device", default="cpu", help="with --pretrained: torch device (cpu, cuda)")
    generate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                          help="with --pretrained: weight dtype (bfloat16 halves the memory)")
    generate.add_argument("--trust-remote-code", action="store_true",
                          help="with --pretrained: let transformers run the checkpoint's tokenizer code (Kimi's)")
    generate.add_argument("--prompt", default="def ", help="text to continue (UTF-8)")
    generate.add_argument("--max-new-tokens", type=int, default=200, help="bytes to generate")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    generate.add_argument("--top-k", type=int, default=None, help="sample among the k most likely bytes")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
    generate.add_argument("--stream", action="store_true", help="print each byte as it is sampled")
    generate.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    generate.set_defaults(run=_generate)
    evaluate = sub.add_parser("eval", help="bits/byte of a checkpoint beside the n-gram baselines of the same bytes")
    evaluate.add_argument("--checkpoint", required=True, help="a step-NNNNNN folder, or a run folder (latest)")
    evaluate.add_argument("--data", nargs="+", default=None, metavar="PATH",
                          help="text files, folders or globs to score (default: the run's validation split)")
    evaluate.add_argument("--eval-bytes", type=_positive_int, default=None,
                          help="bytes to score, in evenly spaced windows (default: the run's train.eval_bytes)")
    evaluate.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    evaluate.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    evaluate.set_defaults(run=_eval)
    runs = sub.add_parser("runs", help="tabulate runs and plot their validation curves in one PNG")
    runs.add_argument("runs", nargs="+", metavar="RUN", help="run folders (as k3course train --out writes them)")
    runs.add_argument("--plot", default="runs.png", help="where to write the PNG")
    runs.set_defaults(run=_runs)
    experiments = sub.add_parser("experiments", help="re-run a saved experiment of chapter 12 (results as JSON)")
    experiments.add_argument("name", help="which experiment: " + ", ".join(_experiment_names()))
    experiments.add_argument("--jobs", type=int, default=1,
                             help="claim experiments: runs trained at a time, each in its own process")
    experiments.add_argument("--budget", choices=_experiment_budgets(), default="default",
                             help="gpu: the four text claims on a CUDA GPU, about one GPU-hour together "
                                  "(saved as NAME-gpu.json)")
    experiments.add_argument("--device", default=None, help="claim experiments: train on this torch device "
                             "(default: the budget's)")
    experiments.set_defaults(run=_experiments)
    return top


TRAINING_COMMANDS = ("train", "experiments")  # long runs whose steps allocate the same temporaries again and again
DEBUG_VARIABLE = "K3COURSE_DEBUG"  # set to 1: bad input shows its traceback instead of one line


def _user_errors() -> tuple[type[Exception], ...]:
    """What bad input raises (a missing or malformed file or folder, a setting out of range): said in one line.
    Any other exception is a bug and keeps its traceback."""
    from k3course.checkpoint import CheckpointError

    return ValueError, OSError, CheckpointError


def _check_device(text: str | None) -> None:
    """``--device``, checked before any work: a torch device string, and a CUDA or MPS device this machine has."""
    if text is None:
        return
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise ValueError(f"--device: {text!r} is not a torch device (expected cpu, cuda, cuda:N or mps)") from error
    counts = {"cuda": torch.cuda.device_count(), "mps": int(torch.backends.mps.is_available())}
    if device.type in counts and (device.index or 0) >= counts[device.type]:
        raise ValueError(f"--device: {text!r}, but this machine has {counts[device.type]} {device.type} devices "
                         "(torch sees none or fewer); use --device cpu")


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input (:func:`_user_errors`) ends in one line on stderr and exit status 2;
    ``K3COURSE_DEBUG=1`` shows its traceback instead."""
    args = parser().parse_args(argv)
    if args.command in TRAINING_COMMANDS:
        from k3course.device import keep_freed_memory

        keep_freed_memory()  # reuse freed memory instead of faulting it in anew every step
    try:
        _check_device(getattr(args, "device", None))
        return args.run(args)
    except Exception as error:
        if not isinstance(error, _user_errors()) or os.environ.get(DEBUG_VARIABLE) == "1":
            raise
        message = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
        print(f"k3course {args.command}: {message or type(error).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
