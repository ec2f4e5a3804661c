"""Training K3 on bytes (the stdlib's or yours): one loop for one process or P expert-parallel ranks.

    config.py    a run's whole configuration (:class:`RunConfig`: [model], [train], [run]), presets, TOML, --set
    step.py      one optimizer step (AdamW, warmup + cosine, clipping, accumulation, balancing), evaluation,
                 :class:`Stepper` (a model, its optimizer and its batches, on one process or one rank)
    loop.py      the one run loop: metrics, evaluation, checkpoints, signals, resume and extend, on any rank
    launch.py    the command line: ``k3course train`` (``--ep P`` spawns P ranks), one torchrun rank
    generate.py  text from a checkpoint (``k3course generate``)

``python -m k3course.train`` is one rank under torchrun (:func:`main`).
"""

from k3course.train.config import (
    DTYPES,
    SECTIONS,
    TRAIN_PRESETS,
    RunConfig,
    RunOptions,
    TrainConfig,
    parse_set,
    read_config_file,
    resolve_config,
    run_config_of,
    run_corpus,
    saved_run_config,
    train_preset,
)
from k3course.train.generate import generate_command, generate_text, load_model, stream_text
from k3course.train.launch import configure, main, train_command, train_expert_parallel, train_rank
from k3course.train.loop import (
    Start,
    StopOnSignal,
    TrainingInterrupted,
    find_start,
    plot_losses,
    prepare_run,
    run,
    save_checkpoint,
    train_run,
)
from k3course.train.step import (
    LN2,
    Stepper,
    balance_experts,
    balance_experts_on_device,
    build_model,
    compile_for_training,
    evaluate,
    forward_precision,
    lr_factor,
    make_optimizer,
    make_scheduler,
    rank_shards,
    read_record,
    step_on_device,
    text_batches,
    train_step,
    training_compile_options,
)

__all__ = ["DTYPES", "LN2", "SECTIONS", "TRAIN_PRESETS", "RunConfig", "RunOptions", "Start", "Stepper",
           "StopOnSignal", "TrainConfig", "TrainingInterrupted", "balance_experts", "balance_experts_on_device",
           "build_model", "compile_for_training", "configure", "evaluate", "find_start", "forward_precision",
           "generate_command", "generate_text", "load_model", "lr_factor", "main", "make_optimizer", "make_scheduler",
           "parse_set", "plot_losses", "prepare_run", "rank_shards", "read_config_file", "read_record",
           "resolve_config", "run", "run_config_of", "run_corpus", "save_checkpoint", "saved_run_config",
           "step_on_device", "stream_text", "text_batches", "train_command", "train_expert_parallel", "train_preset",
           "train_rank", "train_run", "train_step", "training_compile_options"]
