"""The course's two tasks: byte-level Python source, and multi-query associative recall.

Text: the Python standard library's own ``.py`` files, found through the running interpreter (nothing is
downloaded), test packages and site-packages excluded, split into train and validation BY FILE with a rule
on the file's sha256 (so no function is half in each split). Each split is one uint8 array on disk (token =
byte, vocabulary 256), built once into a cache folder and memory-mapped after; training reads fixed-length
windows from it. The n-gram and ``lzma`` baselines are scored on the same validation bytes, in bits per byte:
a model's cross-entropy ℓ (nats per byte) is ℓ / ln 2 bits per byte. Your own text (:func:`text_corpus`: files,
folders, globs) is split and cached the same way; the stdlib stays the default.

Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"; the synthetic task Kimi Linear uses):
a sequence first lists key-value pairs, then asks for some of the keys again; at each query the model must
output the value that followed that key earlier. Recall needs a memory that stores many pairs at once and
retrieves them by content, which is what separates the token mixers of chapters 04–06.
"""

from __future__ import annotations

import glob
import hashlib
import json
import lzma
import math
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

IGNORE = -100  # target at positions that are not queries (torch's cross-entropy ignore_index)
FILLER = 0  # token between queries


def mqar(n_samples: int, seq_len: int, n_pairs: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded MQAR batch: ``(tokens [N, seq_len], targets [N, seq_len])``, both int64.

    Layout of one sequence: ``k_1 v_1 k_2 v_2 … k_n v_n`` then, in the remaining ``seq_len − 2n`` positions,
    the n keys again in a random order at random positions, filler token 0 elsewhere. Keys come from
    ``[1, vocab/2)``, values from ``[vocab/2, vocab)``, each key once per sequence. ``targets`` holds the
    value at each query position and ``IGNORE`` (−100) everywhere else.
    """
    half = vocab_size // 2
    if n_pairs < 1 or half - 1 < n_pairs:
        raise ValueError(f"n_pairs must be in [1, vocab_size/2 − 1] = [1, {half - 1}] (distinct keys), got {n_pairs}")
    if seq_len < 3 * n_pairs:
        raise ValueError(f"seq_len must be ≥ 3·n_pairs = {3 * n_pairs} (pairs, then one query per key), got {seq_len}")
    rng = np.random.default_rng(seed)
    tokens = np.full((n_samples, seq_len), FILLER, dtype=np.int64)
    targets = np.full((n_samples, seq_len), IGNORE, dtype=np.int64)
    for row in range(n_samples):
        keys = rng.choice(np.arange(1, half), size=n_pairs, replace=False)
        values = rng.integers(half, vocab_size, size=n_pairs)
        tokens[row, 0:2 * n_pairs:2], tokens[row, 1:2 * n_pairs:2] = keys, values
        asked = rng.permutation(n_pairs)  # which pair each query asks for
        where = 2 * n_pairs + np.sort(rng.choice(seq_len - 2 * n_pairs, size=n_pairs, replace=False))
        tokens[row, where], targets[row, where] = keys[asked], values[asked]
    return torch.from_numpy(tokens), torch.from_numpy(targets)


# --- harder MQAR: more pairs than the head dimension ------------------------------------------------------

# Lesson 06 stores 6 pairs in a 32-wide state; here 40 pairs must share the tiny preset's 32-dimensional KDA
# heads, so keys cannot all be orthogonal and the mixer has to forget and overwrite selectively.
HARD_MQAR = dict(seq_len=128, n_pairs=40, vocab_size=256)


def mqar_hard(n_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR at :data:`HARD_MQAR` (128 tokens, 40 pairs, vocab 256): ``(tokens, targets)`` [N, 128] int64."""
    return mqar(n_samples, seed=seed, **HARD_MQAR)


# --- a byte-level corpus: the Python standard library's own source ----------------------------------------

FILE_SEPARATOR = 0  # byte written between files (NUL never occurs in the stdlib's .py sources)
VALIDATION_PERCENT = 10  # validation iff (first 64 bits of sha256(relative path), big-endian) mod 100 < 10
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder: ``sysconfig.get_paths()["stdlib"]``."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the stdlib's ``.py`` files, test packages and site-packages excluded.

    A file is excluded when any folder on its path is in :data:`EXCLUDED_DIRS` (``test/``, ``tests/``,
    ``idlelib/idle_test``, ``lib2to3/tests``, ``unittest/test``, ``site-packages`` …).
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"root: no standard-library folder at {root}")
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(relative.parts[:-1]) and path.is_file():
            found.append(relative.as_posix())
    return sorted(found)


def is_validation(relative_path: str) -> bool:
    """The by-file split: the first 64 bits of sha256(path) as a big-endian integer, mod 100, < 10.

    ~10% of the files, the same on every machine and Python version (it reads only the relative path).
    """
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT


def cache_dir() -> Path:
    """Where built corpora live: ``$K3COURSE_CACHE`` if set, else ``~/.cache/k3course``."""
    return Path(os.environ.get("K3COURSE_CACHE") or Path.home() / ".cache" / "k3course")


@dataclass(frozen=True)
class ByteCorpus:
    """Train and validation bytes of a corpus (the stdlib's, or your text) as read-only memory maps (uint8, token =
    byte); ``meta`` describes what was read (``meta["key"]`` names the cache folder)."""

    train: np.ndarray
    val: np.ndarray
    meta: dict

    def split(self, name: str) -> np.ndarray:
        """``'train'`` or ``'val'``: the split's uint8 token array."""
        if name not in ("train", "val"):
            raise ValueError(f"name must be 'train' or 'val', got {name!r}")
        return self.train if name == "train" else self.val


def _atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same folder, then rename: readers see all of it or nothing."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    os.replace(temporary, path)


def _read_split(paths: list[Path]) -> bytes:
    """Concatenation of the files' bytes (NUL bytes dropped), each followed by FILE_SEPARATOR."""
    separator = bytes([FILE_SEPARATOR])
    return b"".join(path.read_bytes().replace(separator, b"") + separator for path in paths)


def _cached_corpus(folder: Path, splits: dict[str, list[Path]], meta: dict) -> ByteCorpus:
    """The corpus in ``folder``: built once from ``splits`` {"train": paths, "val": paths} (each split's bytes,
    then ``meta.json`` = ``meta`` + the split sizes, written last: a half-built cache is rebuilt, never read),
    memory-mapped after."""
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        sizes = {}
        for split, paths in splits.items():
            data = _read_split(paths)
            _atomic_write(folder / f"{split}.bin", data)
            sizes[split] = {"files": len(paths), "bytes": len(data)}
        _atomic_write(meta_path, json.dumps({**meta, "splits": sizes}, indent=1).encode())
    meta = json.loads(meta_path.read_text())
    load = lambda split: np.memmap(folder / f"{split}.bin", dtype=np.uint8, mode="r")
    return ByteCorpus(load("train"), load("val"), meta)


def stdlib_corpus(root: Path | None = None, cache: Path | None = None) -> ByteCorpus:
    """The stdlib corpus, built once into ``cache`` (default :func:`cache_dir`) and memory-mapped after.

    The cache folder's name holds a hash of the file list and sizes, so another Python version (or an edited
    stdlib) builds its own. ``meta.json`` is written last: a half-built cache is rebuilt, never read.
    """
    root = Path(root) if root is not None else stdlib_root()
    files = stdlib_files(root)
    listing = "\n".join(f"{name}:{(root / name).stat().st_size}" for name in files)
    key = hashlib.sha256(listing.encode()).hexdigest()[:16]
    val_files = [name for name in files if is_validation(name)]
    train_files = [name for name in files if not is_validation(name)]
    if not val_files or not train_files:
        raise ValueError(f"root: {root} has {len(files)} .py files, too few for both splits")
    meta = {"root": str(root), "python": sys.version.split()[0], "key": key, "val_files": val_files,
            "rule": "val iff int.from_bytes(sha256(path)[:8], 'big') % 100 < 10"}
    splits = {"train": [root / name for name in train_files], "val": [root / name for name in val_files]}
    return _cached_corpus(Path(cache or cache_dir()) / f"stdlib-{key}", splits, meta)


# --- a byte-level corpus of your own text (k3course train --data PATH ... [--val PATH ...]) -------------------

TEXT_SNIFF_BYTES = 8192  # a file with a NUL byte in its first 8 KiB is binary, not text
GLOB_CHARS = "*?["


def _is_hidden(relative: Path) -> bool:
    """Whether a path inside a folder is hidden: a part starting with '.', or __pycache__."""
    return any(part.startswith(".") or part == "__pycache__" for part in relative.parts)


def _is_text(path: Path, option: str) -> bool:
    """Whether the file holds text (no NUL byte in its first 8 KiB); an unreadable file is a named error."""
    try:
        with path.open("rb") as stream:
            return bytes([FILE_SEPARATOR]) not in stream.read(TEXT_SNIFF_BYTES)
    except OSError as error:
        raise PermissionError(f"{option}: cannot read {path} ({error.strerror or error})") from error


def _walk(folder: Path, base: Path) -> list[tuple[Path, str]]:
    """Every file under ``folder`` that is not hidden (:func:`_is_hidden`), with its path relative to ``base`` as
    the split key."""
    return [(file, file.relative_to(base).as_posix()) for file in sorted(folder.rglob("*"))
            if file.is_file() and not _is_hidden(file.relative_to(folder))]


def _matches(pattern: str, option: str) -> list[tuple[Path, str]]:
    """(file, split key) for one PATH: a file (key: its name), a folder (key: the path inside it) or a glob
    (``**`` recursive; key: the path below the glob's fixed leading folders)."""
    path = Path(os.path.expanduser(pattern))
    magic = [i for i, part in enumerate(path.parts) if any(char in part for char in GLOB_CHARS)]
    if magic:
        base = Path(*path.parts[:magic[0]]) if magic[0] else Path()
        found = [Path(match) for match in sorted(glob.glob(str(path), recursive=True))]
        if not found:
            raise FileNotFoundError(f"{option}: nothing matches {pattern!r}")
        return [entry for match in found
                for entry in (_walk(match, base) if match.is_dir() else [(match, match.relative_to(base).as_posix())])]
    if path.is_file():
        return [(path, path.name)]
    if not path.is_dir():
        raise FileNotFoundError(f"{option}: no file or folder at {pattern!r}")
    return _walk(path, path)


def text_files(paths, option: str = "data") -> list[tuple[Path, str]]:
    """The text files that ``paths`` (files, folders, globs) name, as (absolute path, split key), each file once.

    Files with a NUL byte in their first 8 KiB are binary and skipped (a binary file named by itself is an
    error). Errors name ``option``: a path that matches nothing, an unreadable file, no text file at all.
    """
    if isinstance(paths, str | Path) or not paths:
        raise ValueError(f"{option}: expected a list of one or more files, folders or globs, got {paths!r}")
    chosen: dict[Path, str] = {}
    for pattern in map(str, paths):
        for path, key in _matches(pattern, option):
            path = path.resolve()
            if path in chosen:
                continue
            if _is_text(path, option):
                chosen[path] = key
            elif Path(os.path.expanduser(pattern)).resolve() == path:
                raise ValueError(f"{option}: {pattern} is not text (a NUL byte in its first 8 KiB)")
    if not chosen:
        raise ValueError(f"{option}: no text file in {', '.join(map(str, paths))}")
    return list(chosen.items())


def text_bytes(paths, option: str = "data") -> tuple[np.ndarray, int]:
    """The bytes of the text files ``paths`` names, as a corpus split holds them (each file followed by
    FILE_SEPARATOR), as uint8, and how many files they are."""
    files = [path for path, _ in text_files(paths, option)]
    return np.frombuffer(_read_split(files), dtype=np.uint8), len(files)


def _by_file_split(entries: list[tuple[Path, str]]) -> tuple[list[Path], list[Path]]:
    """(train, val) files of ``entries`` by :func:`is_validation` on their split keys; both must be non-empty."""
    val = [path for path, key in entries if is_validation(key)]
    train = [path for path, key in entries if not is_validation(key)]
    if not val or not train:
        missing = "validation" if train else "training"
        raise ValueError(f"data: the {len(entries)} file(s) give no {missing} file by the {VALIDATION_PERCENT}% "
                         "by-file split; add files, or name validation files with --val")
    return train, val


def text_corpus(paths, val=(), cache: Path | None = None) -> ByteCorpus:
    """A corpus of your own text: the files ``paths`` names, split BY FILE with the stdlib's rule
    (:func:`is_validation` on each file's split key, see :func:`text_files`), or, when ``val`` names files,
    ``paths`` for training and ``val`` for validation. Built once into ``cache`` (default :func:`cache_dir`),
    in a folder named by a hash of the files' paths, sizes and modification times, and memory-mapped after.
    """
    entries = text_files(paths, "data")
    if val:
        train_paths, val_paths = [path for path, _ in entries], [path for path, _ in text_files(val, "val")]
        shared = sorted(set(train_paths) & set(val_paths))
        if shared:
            raise ValueError(f"val: {shared[0]} is also named by data; a file belongs to one split")
    else:
        train_paths, val_paths = _by_file_split(entries)
    splits = {"train": train_paths, "val": val_paths}
    for split, files in splits.items():
        if sum(path.stat().st_size for path in files) == 0:
            raise ValueError(f"{'val' if val and split == 'val' else 'data'}: the {split} files are all empty")
    listing = "\n".join(f"{split}:{path}:{path.stat().st_size}:{path.stat().st_mtime_ns}"
                        for split, files in splits.items() for path in files)
    key = hashlib.sha256(listing.encode()).hexdigest()[:16]
    rule = "files named by val" if val else "val iff int.from_bytes(sha256(key)[:8], 'big') % 100 < 10"
    meta = {"data": list(map(str, paths)), "val": list(map(str, val)), "key": key,
            "val_files": list(map(str, val_paths)), "rule": rule}
    return _cached_corpus(Path(cache or cache_dir()) / f"text-{key}", splits, meta)


def batch_at(tokens: np.ndarray, index: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Batch number ``index`` of a seeded stream: ``(inputs, targets)`` [batch_size, seq_len] int64.

    Start offsets are drawn uniformly from ``[0, len − seq_len − 1)`` by ``default_rng([seed, index])``, so a
    batch depends only on (seed, index): a resumed run needs nothing but the index (the data position).
    targets = inputs shifted by one byte.
    """
    if len(tokens) < seq_len + 2:
        raise ValueError(f"seq_len: {seq_len} needs at least {seq_len + 2} tokens, the split has {len(tokens)}")
    rng = np.random.default_rng([seed, index])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    windows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts]).astype(np.int64)
    windows = torch.from_numpy(windows)
    return windows[:, :-1], windows[:, 1:]


def eval_windows(tokens: np.ndarray, seq_len: int, n_bytes: int | None) -> torch.Tensor:
    """Evenly spaced, non-overlapping windows of ``seq_len + 1`` bytes covering ~``n_bytes`` predictions.

    Returns [N, seq_len + 1] int64; ``n_bytes=None`` tiles the whole split. Deterministic (no seed).
    """
    n_available = (len(tokens) - 1) // seq_len
    n_windows = n_available if n_bytes is None else max(1, min(n_available, n_bytes // seq_len))
    starts = np.linspace(0, (n_available - 1) * seq_len, n_windows).astype(np.int64) // seq_len * seq_len
    return torch.from_numpy(np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts]).astype(np.int64))


# --- baselines --------------------------------------------------------------------------------------------

LOG2 = math.log(2)


def ngram_bits_per_byte(train: np.ndarray, val: np.ndarray, order: int, k: float = 0.1) -> float:
    """Bits per byte of an add-k byte n-gram model fitted on ``train``, scored on ``val``.

    P(c | h) = (n(h c) + k) / (n(h) + 256 k), h = the previous ``order − 1`` bytes (order 1 = unigram).
    Validation bytes without a full history (the first ``order − 1``) are not scored. ``val`` [N] is one text;
    [R, N] is R texts (windows), each scored on its own.
    """
    if order not in (1, 2, 3):
        raise ValueError(f"order must be 1, 2 or 3, got {order}")
    size = 256 ** order
    codes = lambda x: sum(np.asarray(x[..., i:x.shape[-1] - order + 1 + i], dtype=np.int64) << (8 * (order - 1 - i))
                          for i in range(order))
    counts = np.bincount(codes(train), minlength=size).astype(np.float64)
    history = counts.reshape(-1, 256).sum(1)
    val_codes = codes(val)
    probs = (counts[val_codes] + k) / (history[val_codes >> 8] + 256 * k)
    return float(-np.log2(probs).mean())


def lzma_bits_per_byte(data: np.ndarray) -> float:
    """8 · len(lzma -9 of data) / len(data): a general-purpose compressor as a reference point."""
    raw = np.asarray(data).tobytes()
    return 8 * len(lzma.compress(raw, preset=9)) / len(raw)


def window_baselines(train: np.ndarray, windows: np.ndarray, k: float = 0.1) -> dict[str, float]:
    """Bits/byte of the add-k n-grams fitted on ``train`` and of lzma -9 on the bytes a model predicts from
    ``windows`` [N, T + 1], the bytes :func:`k3course.train.step.evaluate` scores: each window's from its second on
    (the trigram's from its third: it needs two bytes of history)."""
    windows = np.asarray(windows, dtype=np.uint8)
    result = {name: ngram_bits_per_byte(train, windows[:, max(0, 2 - order):], order, k)
              for order, name in ((1, "unigram"), (2, "bigram"), (3, "trigram"))}
    result["lzma-9"] = lzma_bits_per_byte(windows[:, 1:])
    return result


def baselines(corpus: ByteCorpus, k: float = 0.1) -> dict[str, float]:
    """Validation bits/byte of unigram, bigram, trigram (add-k) and lzma -9 on the corpus's split.

    k = 0.1 is near the best add-k for the trigram on the stdlib split (Python 3.11: k = 1, 0.1, 0.01, 0.001
    give 2.71, 2.66, 2.66, 2.68 bits/byte): chosen on validation, so it flatters the baseline, not the model.
    Cached in the corpus folder next to the bytes (computing them takes a few seconds).
    """
    path = Path(corpus.train.filename).parent / f"baselines-k{k}.json"
    if path.exists():
        return json.loads(path.read_text())
    result = {f"{name}": ngram_bits_per_byte(corpus.train, corpus.val, order, k)
              for order, name in ((1, "unigram"), (2, "bigram"), (3, "trigram"))}
    result["lzma-9"] = lzma_bits_per_byte(corpus.val)
    _atomic_write(path, json.dumps(result, indent=1).encode())
    return result
