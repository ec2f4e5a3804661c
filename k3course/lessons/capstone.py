"""The capstone (lesson 16): your own chapter functions, taken from your exercise notebooks, inside the model.

:func:`your_parts` reads each function you wrote (:data:`PART_NOTEBOOKS`) from your saved exercise notebook — every
code cell up to the one that defines it, as Run All would (check cells left out), so helpers from other cells work —
and falls back to the solved notebook in ``solutions/`` where your exercise is still a stub. :func:`finetune`
continues a model with your training step and schedule. :func:`shipped_model` is the tiny K3 that
``k3course train --preset tiny`` trained for 2400 steps, shipped with the package (:data:`SHIPPED`);
:func:`train_on_ranks` continues it on P gloo ranks with expert-parallel experts.

    part              chapter    where it runs
    topk_route        01         in every MoE layer: top-k on s + b, weights from s
    shared_experts    01         in every MoE layer: the shared experts' gated FFN
    situ_glu          02         every SiTU-GLU: routed experts, shared experts, the dense FFN
    latent_combine    02         in every MoE layer: RMSNorm(Σ p E) W↑
    quantile_balance_bias 03     where training moves the MoE bias (one process)
    short_conv        06         in every KDA layer: the causal depthwise convolutions of q, k, v
    kda_gate          06         in every KDA layer: the forget gate g
    kda_step          06         in the recurrent KDA path (decoding, inputs of up to one chunk)
    ut_transform      07         in the chunked KDA path (training; prefill longer than a chunk)
    mla_output_gate   09         in every MLA layer: σ(x W_G) ⊙ heads
    depth_attention   10         in every Block AttnRes read
    sample_next       11         your generate's choice of the next token
    generate          11         prefill, then one cached step per new token
    lr_factor         12         the warmup + cosine schedule of your training steps
    train_step        12         one optimizer step
    bits_per_byte     12         your evaluator (exercise 12.evaluate)
    all_to_all        13         the expert-parallel dispatch and combine (on P ranks)
    predicted_tpot    14         the roofline time per output token

The parts the model looks up by name (:data:`k3course.lessons.parts.PART_NAMES`) enter it through
:func:`~k3course.lessons.parts.use_parts`; the others the lesson calls itself.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import linecache
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nbformat
import numpy as np
import safetensors.torch
import torch

from k3course import checkpoint, data, distributed, train
from k3course.config import K3Config
from k3course.device import best_seconds
from k3course.lessons.fit import schedule
from k3course.lessons.parts import PART_NAMES, use_parts
from k3course.train.config import read_saved_run, run_corpus
from k3course.train.generate import load_model
from k3course.train.step import make_optimizer, rank_shards, train_step

# part -> the exercise notebook (in exercises/ and solutions/) whose function it is
PART_NOTEBOOKS: dict[str, str] = {
    "topk_route": "01_sparse_moe_exercises.ipynb",
    "shared_experts": "01_sparse_moe_exercises.ipynb",
    "situ_glu": "02_latent_moe_exercises.ipynb",
    "latent_combine": "02_latent_moe_exercises.ipynb",
    "quantile_balance_bias": "03_quantile_routing_exercises.ipynb",
    "kda_step": "06_kda_exercises.ipynb",
    "short_conv": "06_kda_exercises.ipynb",
    "kda_gate": "06_kda_exercises.ipynb",
    "ut_transform": "07_chunkwise_exercises.ipynb",
    "mla_output_gate": "09_gated_mla_exercises.ipynb",
    "depth_attention": "10_residuals_exercises.ipynb",
    "sample_next": "11_model_exercises.ipynb",
    "generate": "11_model_exercises.ipynb",  # after sample_next: your generate calls your sample_next
    "lr_factor": "12_train_exercises.ipynb",
    "train_step": "12_train_exercises.ipynb",
    "bits_per_byte": "12_train_exercises.ipynb",
    "all_to_all": "13_expert_parallel_exercises.ipynb",
    "predicted_tpot": "14_decoding_exercises.ipynb",
}
STUB = "raise NotImplementedError"
CHECK_CELL = re.compile(r"^check\(", re.M)  # a cell that calls the grader: it grades, it defines nothing
EXERCISE_EPS = 1e-6  # the RMSNorm ε chapter 10's depth_attention exercise writes into its function


@dataclass(frozen=True)
class Part:
    """One of your functions: its ``name``, the function, and the notebook it came from."""

    name: str
    function: Callable
    notebook: Path

    @property
    def whose(self) -> str:
        """"yours" when it came from your exercise notebook, "the solution's" when from ``solutions/``."""
        return "the solution's" if self.notebook.parts[0] == "solutions" else "yours"


def _defining_cells(cells: list[str], names: list[str]) -> dict[str, int]:
    """{name: index of the first of ``cells`` that defines ``def name(``} for the names some cell defines."""
    found = {}
    for name in names:
        pattern = re.compile(rf"^def {name}\(", re.M)
        index = next((i for i, source in enumerate(cells) if pattern.search(source)), None)
        if index is not None:
            found[name] = index
    return found


def notebook_functions(path: Path | str, names: list[str]) -> tuple[dict[str, Callable], dict]:
    """The functions ``names`` as the notebook at ``path`` defines them, from one run of its code cells in order
    (as Run All would, check cells left out and what the cells print swallowed) up to the last cell that defines
    one of them: a function may call helpers from any earlier cell. Returns ({name: function} without the names
    that no cell defines or whose definition is still the stub, the namespace the cells ran in); ({}, {}) when
    there is no notebook at ``path``."""
    path = Path(path)
    if not path.is_file():
        return {}, {}
    cells = [cell.source for cell in nbformat.read(path, 4).cells
             if cell.cell_type == "code" and not CHECK_CELL.search(cell.source)]
    defining = _defining_cells(cells, names)
    namespace: dict = {"__name__": f"notebook_{path.stem}"}
    for index, source in enumerate(cells[:max(defining.values(), default=-1) + 1]):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(_compiled_cell(source, f"{path} (code cell {index + 1})"), namespace)
        except Exception as error:
            raise RuntimeError(f"path: code cell {index + 1} of {path} raised {type(error).__name__}: {error}; "
                               f"it runs before your function is read from the notebook") from error
    return {name: namespace[name] for name, index in defining.items() if STUB not in cells[index]}, namespace


def function_from_notebook(path: Path | str, name: str) -> Callable | None:
    """The function ``name`` as the notebook at ``path`` defines it (:func:`notebook_functions`), fitted to the
    model's call; None when no cell defines it or the definition is still the stub."""
    function = notebook_functions(path, [name])[0].get(name)
    return None if function is None else fitted(name, function)


def _compiled_cell(source: str, filename: str):
    """``source`` compiled as the file ``filename``, its lines registered where ``inspect.getsource`` looks (as
    IPython does for a cell): a ``@triton.jit`` function reads its own source when it is defined."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return compile(source, filename, "exec")


KDA_KERNELS = ("kda_intra_chunk", "kda_state_pass", "kda_chunk_output")  # chapter 08's three, in the order they run


def your_kda_chunk(root: Path | str = "..", folder: str = "exercises") -> tuple[Callable, Path]:
    """Chapter 08's three KDA kernels from your exercise notebook (else the solutions' where one of yours is not
    written yet), composed by ``kda_chunk_from_kernels`` into the whole chunked KDA forward: (the op, for
    ``use_parts(kda_chunk=...)``, and the notebook its kernels came from). Forward only: it has no backward."""
    from k3course.kernels.kda_chunk import kda_chunk_from_kernels  # here: selecting the Triton mode comes first

    root = Path(root)
    for where in (root / folder / "08_triton_exercises.ipynb", root / "solutions" / "08_triton_exercises.ipynb"):
        kernels = notebook_functions(where, list(KDA_KERNELS))[0]
        if len(kernels) == len(KDA_KERNELS):
            return kda_chunk_from_kernels(*(kernels[name] for name in KDA_KERNELS)), where.relative_to(root)
    raise FileNotFoundError(f"root: no 08_triton_exercises.ipynb under {root} defines {', '.join(KDA_KERNELS)}")


def fitted(name: str, function: Callable) -> Callable:
    """``function`` callable the way the model calls the part. The model calls ``depth_attention(query, sources,
    eps)``; chapter 10's exercise takes ``(query, sources)`` with its ε = 1e-6 written in, so it is wrapped to
    accept that ε (and refuse another, which it would silently ignore)."""
    if name != "depth_attention" or "eps" in inspect.signature(function).parameters:
        return function

    def depth_attention(query, sources, eps=EXERCISE_EPS):
        if eps != EXERCISE_EPS:
            raise ValueError(f"eps: your depth_attention uses ε = {EXERCISE_EPS}; the model asks for {eps}")
        return function(query, sources)

    return depth_attention


def your_parts(root: Path | str = "..", folder: str = "exercises") -> list[Part]:
    """Your function for each part of :data:`PART_NOTEBOOKS`, from ``root/folder`` (your saved exercise
    notebooks), else from ``root/solutions`` where yours is not written yet. Each notebook runs once; where the
    solution's function stands in for a stub of yours, your functions call it in the stub's place and it calls
    yours (the solved ``generate`` calls your ``sample_next``, yours the solved one until you write it)."""
    root = Path(root)
    by_notebook: dict[str, list[str]] = {}
    for name, notebook in PART_NOTEBOOKS.items():
        by_notebook.setdefault(notebook, []).append(name)
    found: dict[str, Part] = {}
    for notebook, names in by_notebook.items():
        yours, namespace = notebook_functions(root / folder / notebook, names)
        missing = [name for name in names if name not in yours]
        solved, solved_namespace = notebook_functions(root / "solutions" / notebook, missing) if missing else ({}, {})
        solved_namespace.update(yours)  # the solution's functions call yours, looked up when they run
        for name in missing:
            if name not in solved:
                raise FileNotFoundError(f"root: no notebook under {root} defines {name} ({notebook})")
            namespace[name] = solved[name]  # and yours call the solution's in place of your stubs
        for name in names:
            where = (root / folder / notebook) if name in yours else (root / "solutions" / notebook)
            found[name] = Part(name, fitted(name, yours.get(name) or solved[name]), where.relative_to(root))
    return [found[name] for name in PART_NOTEBOOKS]


def model_parts(parts: list[Part]) -> dict[str, Callable]:
    """{name: function} of the ``parts`` the model looks up by name (:data:`~k3course.lessons.parts.PART_NAMES`), the
    keyword arguments of :func:`~k3course.lessons.parts.use_parts`."""
    return {part.name: part.function for part in parts if part.name in PART_NAMES}


def capstone_config() -> K3Config:
    """The tiny K3 with 128-byte windows, so the chunked KDA path (two chunks of 64) runs ``ut_transform``."""
    return K3Config.preset("tiny")


def finetune(model: torch.nn.Module, train_step: Callable, lr_factor: Callable, batches: list[list],
             config: train.TrainConfig) -> list[float]:
    """Continue ``model`` for len(``batches``) steps of ``train_step`` (chapter 12's signature), step i on the
    micro-batches ``batches[i]``: AdamW with ``config``'s rate, betas, weight decay and gate_lr_scale, the rate of
    step i lr · lr_factor(i, warmup_steps, steps, min_lr_ratio) (:func:`k3course.lessons.fit.schedule` with your
    ``lr_factor``). Your ``train_step`` takes the whole step itself, so this is the one lesson loop that is not
    :func:`~k3course.lessons.fit.fit`'s. Returns the loss of each step."""
    groups = model.param_groups(config.weight_decay, config.gate_lr_scale, lr=config.lr)
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
    scheduler = schedule(optimizer, config.steps, warmup_steps=config.warmup_steps, min_lr_ratio=config.min_lr_ratio,
                         lr_factor=lr_factor)
    return [train_step(model, optimizer, scheduler, micro_batches, config.grad_clip)["loss"]
            for micro_batches in batches]


# --- the shipped model ----------------------------------------------------------------------------------

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny"
SHIPPED_DTYPE = torch.bfloat16  # half of float32's bytes; its rounding moves validation bits/byte by ~1e-4


def ship_checkpoint(run: Path | str, out: Path | str = SHIPPED) -> Path:
    """Write the latest checkpoint of the run folder ``run`` as the package ships it, into ``out``:
    model.safetensors (floating parameters in :data:`SHIPPED_DTYPE`, buffers — the balancing biases — as saved),
    config.json, the run's metrics.jsonl up to the checkpoint's step, and val_windows.npy: the windows [N, T + 1]
    uint8 of the run's validation split that its evaluations scored (the split must be the one this machine reads)."""
    folder, out = checkpoint.find_checkpoint(run), Path(out)
    saved = json.loads((folder / "config.json").read_text())
    corpus = run_corpus(read_saved_run(folder).config.run)
    if corpus.meta["key"] != saved["corpus"]["key"]:
        raise ValueError(f"run: {run} was trained on corpus {saved['corpus']['key']}, this machine reads "
                         f"{corpus.meta['key']}")
    model = load_model(folder)
    parameters = {name for name, _ in model.named_parameters()}
    state = {name: tensor.to(SHIPPED_DTYPE) if name in parameters else tensor
             for name, tensor in model.state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(saved, indent=1))
    lines = (Path(run) / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= saved["step"]))
    windows = data.eval_windows(corpus.val, saved["train"]["seq_len"], saved["train"]["eval_bytes"])
    np.save(out / "val_windows.npy", windows.numpy().astype(np.uint8))
    return out


def shipped_config(folder: Path | str = SHIPPED) -> dict:
    """The shipped run's config.json: {"model": K3Config, "train": TrainConfig fields, "step", "corpus", ...}."""
    saved = json.loads((Path(folder) / "config.json").read_text())
    return {**saved, "model": K3Config.from_dict(saved["model"])}


def shipped_model(folder: Path | str = SHIPPED) -> torch.nn.Module:
    """The shipped tiny K3 in float32 and eval mode: its stored weights widened back from :data:`SHIPPED_DTYPE`."""
    from k3course.model import K3Model

    model = K3Model.from_config(shipped_config(folder)["model"])
    stored = safetensors.torch.load_file(str(Path(folder) / "model.safetensors"))
    expected = model.state_dict()
    if set(stored) != set(expected):
        raise checkpoint.CheckpointError(f"folder: {folder} holds another model's weights: "
                                         f"{sorted(set(stored) ^ set(expected))[:4]} differ")
    model.load_state_dict({name: tensor.to(expected[name].dtype) for name, tensor in stored.items()})
    return model.eval()


def shipped_metrics(folder: Path | str = SHIPPED) -> list[dict]:
    """The shipped run's metrics.jsonl: one record a step; steps that evaluated also hold val_loss and val_bpb."""
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines() if line]


def shipped_windows(folder: Path | str = SHIPPED) -> torch.Tensor:
    """The validation windows [N, T + 1] int64 the shipped run's evaluations scored."""
    return torch.from_numpy(np.load(Path(folder) / "val_windows.npy").astype(np.int64))


def copy_bandwidth(n_bytes: int = 2 ** 27, repeats: int = 3) -> float:
    """This machine's memory bandwidth in bytes/s, measured: a float32 copy of ``n_bytes`` reads and writes them
    (2 · n_bytes moved), the best of ``repeats``."""
    source = torch.ones(n_bytes // 4)
    target = torch.empty_like(source)
    return 2 * n_bytes / best_seconds(lambda: target.copy_(source), repeats)


# --- the shipped model on P ranks -----------------------------------------------------------------------

def _steps_on_rank(rank: int, world_size: int, batches: list[list], config: train.TrainConfig,
                   parts: dict[str, Callable]) -> list[float]:
    """On one rank: the shipped model with expert-parallel experts, trained by the package's step on this rank's
    1/P of every micro-batch of ``batches`` (AdamW and schedule of ``config``), ``parts`` in place."""
    model = distributed.parallelize_experts(shipped_model())
    optimizer, scheduler = make_optimizer(model, config)
    with use_parts(**parts):
        return [train_step(model, optimizer, scheduler, rank_shards(micro_batches, rank, world_size),
                                 config.grad_clip)["loss"] for micro_batches in batches]


def train_on_ranks(world_size: int, batches: list[list], config: train.TrainConfig,
                   parts: dict[str, Callable]) -> list[list[float]]:
    """Each rank's losses when ``world_size`` forked gloo processes continue the shipped model together for
    len(``batches``) steps with expert-parallel experts (:func:`~k3course.distributed.parallelize_experts`), with
    ``parts`` (e.g. your ``all_to_all``: the dispatch and the combine) in place of the package's. Every rank
    reports the loss of the whole batch, which equals one process's to float rounding."""
    return distributed.run_ranks(_steps_on_rank, world_size, batches, config, parts, start_method="fork")
