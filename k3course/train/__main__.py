"""``torchrun --standalone --nproc-per-node P -m k3course.train --ep P --preset tiny [--steps N]``: one rank of a
P-rank run (gloo on CPU; NCCL with rank r on GPU r when every rank has a GPU), trained by the door,
:func:`k3course.train.train` with ``ranks=P``, on the FSDP2 × EP mesh 1 × P, or N × M with ``--dp-shard N --ep M``
(N·M = torchrun's world size, over one node or several), with sharded checkpoints; ``--config``, ``--out``,
``--set``, ``--resume`` and ``--extend-to`` as in ``k3course train``."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from k3course import checkpoint, distributed
from k3course.train.launch import configure
from k3course.train.loop import TrainingInterrupted, train


def _rank(argv: list[str] | None = None) -> int:
    """This process as one torchrun rank (see the module docstring); returns its exit status."""
    parser = argparse.ArgumentParser(prog="python -m k3course.train", description=__doc__)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--config", default=None, metavar="TOML")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--extend-to", type=int, default=None, metavar="N")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default: world size / dp-shard)")
    parser.add_argument("--dp-shard", type=int, default=1, help="FSDP2 rows of the mesh (default: 1)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run me under torchrun (or use `k3course train --ep P`, which spawns the ranks itself)")
    world_size = int(os.environ["WORLD_SIZE"])
    ep = args.ep if args.ep is not None else world_size // max(1, args.dp_shard)
    if args.dp_shard < 1 or args.dp_shard * ep != world_size:
        parser.error(f"--dp-shard {args.dp_shard} × --ep {ep} must equal torchrun's world size ({world_size})")
    device = "cpu"
    if torch.cuda.device_count() >= world_size:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    distributed.join_group("gloo" if device == "cpu" else "nccl")  # its threads end with destroy_process_group
    rank = dist.get_rank()
    steps = [] if args.steps is None else [("--steps", "train.steps", args.steps)]
    try:
        config, out, resume, _ = configure(args.preset, args.out, args.config, steps, args.set, args.resume,
                                           args.extend_to)
        train(config, out, resume, ranks=world_size, dp_shard=args.dp_shard, device=device, progress=rank == 0)
        dist.barrier()  # every rank done before any tears its connections down (as run_ranks does)
    except TrainingInterrupted as stopped:  # every rank stops at the same step (loop.py), so all of them are here
        dist.barrier()
        if rank == 0:
            print(stopped, file=sys.stderr)
        return 128 + stopped.signum
    finally:
        dist.destroy_process_group()
    if rank == 0:
        final = checkpoint.read_metrics(out)[-1]
        print(f"step {final['step']}: loss {final['loss']:.4f}; checkpoints and metrics.jsonl in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_rank())
