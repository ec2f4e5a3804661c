"""Training K3 on bytes (the stdlib's or yours): one door, :func:`train`, for one process or P ranks (FSDP2 × EP).

    from k3course.train import RunConfig, TrainConfig, train
    config = RunConfig(model_config, TrainConfig(steps=800))
    train(config, "runs/tiny")                                            # a fresh run
    train(config, "runs/tiny", resume=True)                               # continue it exactly
    train(RunConfig(model_config, TrainConfig(steps=1200)), "runs/tiny", resume="extend")  # on, a new tail

A rank of a P-rank run calls the same door with ``ranks=P`` (``python -m k3course.train`` under torchrun
does); ``k3course train --ep P`` (``--dp-shard N --ep M``) spawns the local ranks through it. :class:`Stepper`
is the step the lessons drive themselves: a seeded model, its optimizer and schedule, one optimizer step per call.

    config.py    a run's whole configuration (:class:`RunConfig`: [model], [train], [run]), presets, TOML, --set;
                 :class:`~k3course.train.config.SavedRun`, a checkpoint's record, read once
    step.py      one optimizer step (AdamW, warmup + cosine, clipping, accumulation, balancing), evaluation,
                 :class:`Stepper` (a model, its optimizer and its batches, on one process or one rank)
    loop.py      the door and the one run loop: metrics, evaluation, checkpoints, signals, resume and extend
    launch.py    the configuration a command line trains (``k3course train``, a torchrun rank)
    generate.py  text from a checkpoint (``k3course generate``)
    __main__.py  one torchrun rank: ``torchrun --nproc-per-node P -m k3course.train --ep P ...``
"""

from k3course.train.config import RunConfig, RunOptions, TrainConfig
from k3course.train.loop import TrainingInterrupted, train
from k3course.train.step import Stepper, build_model, text_batches

__all__ = ["RunConfig", "RunOptions", "Stepper", "TrainConfig", "TrainingInterrupted", "build_model", "text_batches",
           "train"]
