"""Text from a trained run: the model of a checkpoint, continued byte by byte (``k3course generate``)."""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

import torch

from k3course import checkpoint


def load_model(path: Path | str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model of a checkpoint folder, or of the latest checkpoint of a run folder, in eval mode."""
    folder = checkpoint.find_checkpoint(path)
    config = checkpoint.read_config(folder)
    from k3course.model import K3Model

    model = K3Model.from_config(config["model"], device=device)
    checkpoint.load_weights(folder, model)
    return model.eval()


def _prompt_tokens(model: torch.nn.Module, prompt: str) -> torch.Tensor:
    """The prompt's UTF-8 bytes as tokens [1, n] on the model's device; a non-UTF-8 or empty prompt is an error."""
    try:
        prompt_bytes = prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"prompt: not valid UTF-8 text ({error.reason} at position {error.start})") from error
    if not prompt_bytes:
        raise ValueError("prompt: must not be empty (the model needs at least one byte to continue)")
    return torch.tensor([list(prompt_bytes)], dtype=torch.int64, device=next(model.parameters()).device)


def stream_text(model: torch.nn.Module, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                top_k: int | None = None, seed: int = 0) -> Iterator[str]:
    """The prompt, then its continuation as it is sampled, byte by byte, as text pieces (a character of several
    bytes comes once it is complete; bytes that are not valid UTF-8 come as U+FFFD). Arguments are checked at
    the call."""
    tokens = _prompt_tokens(model, prompt)
    sampled = model.stream(tokens, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return _decoded(prompt, sampled)


def _decoded(prompt: str, sampled: Iterator[torch.Tensor]) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    yield prompt
    for token in sampled:
        yield decoder.decode(bytes([int(token)]))
    yield decoder.decode(b"", final=True)


def generate_text(model: torch.nn.Module, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = None, seed: int = 0) -> str:
    """The prompt continued byte by byte; bytes that are not valid UTF-8 are shown as U+FFFD."""
    return "".join(stream_text(model, prompt, max_new_tokens, temperature, top_k, seed))



def generate_command(checkpoint_path: Path | str, prompt: str, max_new_tokens: int = 200,
                     temperature: float = 0.8, top_k: int | None = None, seed: int = 0) -> Iterator[str]:
    """``k3course generate``: the prompt continued by the model of a checkpoint (or a run's latest), as the
    text pieces of :func:`stream_text` (join them for the whole text)."""
    model = load_model(checkpoint_path)
    return stream_text(model, prompt, max_new_tokens, temperature, top_k, seed)

