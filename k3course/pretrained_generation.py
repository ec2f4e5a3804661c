"""Generation from a checkpoint that transformers wrote (``k3course generate --pretrained PATH``): the
checkpoint's own tokenizer, and the text :meth:`K3Model.from_pretrained <k3course.model.K3Model.from_pretrained>`
generates with it. transformers (the ``oracle`` extra) is imported only inside the functions that need it.

    import_transformers   the package, imported after the Triton mode is chosen
    load_tokenizer        a checkpoint's own tokenizer (AutoTokenizer, local files only), or None
    tokenizer_options     AutoTokenizer's options for a folder (Kimi K2's ``kimi_k2``: by tokenizer_config.json)
    pretrained_text       the prompt and its continuation, piece by piece as tokens arrive
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from k3course import kernels
from k3course.model import K3Model
from k3course.pretrained import CONFIG_FILE, PretrainedFolder, read_json_object


def import_transformers():
    """The transformers package, imported after :func:`k3course.kernels.select_triton_mode` (transformers imports
    fla, which imports triton: the Triton mode must be chosen first) and without fla's notice that Triton has no
    GPU here."""
    kernels.select_triton_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Triton is not supported", category=UserWarning)
        importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
        return importlib.import_module("transformers")


def load_tokenizer(path: Path | str, trust_remote_code: bool = False):
    """The checkpoint's own tokenizer through transformers' AutoTokenizer (local files only, nothing downloaded),
    or None when the folder holds no tokenizer files. The released Kimi checkpoints ship their tokenizer as code
    (``tokenization_kimi.py``): loading it runs that code, so it needs ``trust_remote_code=True``. A
    ``tokenizer.json`` that is not JSON is named; a config.json of a model type transformers does not know (Kimi
    K2's ``kimi_k2``) is not consulted (:func:`tokenizer_options`)."""
    path = Path(path)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tiktoken.model")):
        return None
    if (path / "tokenizer.json").exists():
        read_json_object(path / "tokenizer.json")
    auto = import_transformers().AutoTokenizer
    return auto.from_pretrained(path, **tokenizer_options(path, trust_remote_code))


def tokenizer_options(path: Path, trust_remote_code: bool) -> dict:
    """AutoTokenizer's options for folder ``path``: local files only; and when config.json names a model type
    transformers has no config class for (``kimi_k2``), an empty config in its place, so that the tokenizer class
    comes from tokenizer_config.json as the release intends (transformers' own lookup of that config fails with an
    AttributeError, with or without trust_remote_code)."""
    hf = import_transformers()
    options = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    model_type = read_json_object(path / CONFIG_FILE).get("model_type") if (path / CONFIG_FILE).is_file() else None
    if model_type not in hf.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        options["config"] = hf.PreTrainedConfig()
    return options


def pretrained_text(path: Path | str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8,
                    top_k: int | None = None, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                    trust_remote_code: bool = False) -> Iterator[str]:
    """``k3course generate --pretrained PATH``: the prompt continued by ``K3Model.from_pretrained(path)``, encoded
    and decoded with the checkpoint's tokenizer (:func:`load_tokenizer`), or as UTF-8 bytes when it has none and
    its vocabulary holds the 256 byte values (a course model saved with ``save_pretrained``). Yields the prompt,
    then the continuation as it grows (text held back while it ends in an incomplete character, U+FFFD)."""
    checkpoint = PretrainedFolder(path)  # the folder, its config and its files checked before any weight is read
    tokenizer = load_tokenizer(path, trust_remote_code)
    vocab = checkpoint.config.vocab_size
    if tokenizer is None and vocab != 256:
        raise ValueError(f"path: {path} holds no tokenizer, and its vocabulary ({vocab} tokens) is not the 256 byte "
                         "values that text is read as without one")
    model = K3Model.from_checkpoint(checkpoint, device=device, dtype=dtype)
    encode = (lambda text: tokenizer(text)["input_ids"]) if tokenizer else (lambda text: list(text.encode()))
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else \
        (lambda ids: bytes(ids).decode(errors="replace"))
    ids = encode(prompt)
    if not ids:
        raise ValueError(f"prompt: {prompt!r} encodes to no tokens")
    sampled = model.stream(torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, seed)
    return _grown(prompt, sampled, decode)


def _grown(prompt: str, sampled: Iterator[torch.Tensor], decode) -> Iterator[str]:
    """The prompt, then each piece the decoded continuation adds as tokens arrive."""
    yield prompt
    new: list[int] = []
    shown = ""
    for token in sampled:
        new.append(int(token))
        text = decode(new)
        if text.startswith(shown) and not text.endswith("\ufffd"):
            yield text[len(shown):]
            shown = text
    yield decode(new)[len(shown):]
