"""The stdlib byte corpus (built from a fake root in tmp_path, and the real listing), batches, baselines, MQAR."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from k3course import data


def _fake_stdlib(root):
    """20 modules (m1, m5, m6, m12 fall in validation), a test package, site-packages and a non-.py file."""
    for i in range(20):
        path = root / "pkg" / f"m{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"def f{i}(x):\n    return x + {i}\n".encode() * (i + 1))
    for skipped in ("test/test_a.py", "pkg/tests/t.py", "site-packages/lib/x.py", "idlelib/idle_test/i.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("SKIPPED = 1\n")
    (root / "pkg" / "notes.txt").write_text("not python\n")
    return root


@pytest.fixture
def fake_corpus(tmp_path):
    return data.stdlib_corpus(_fake_stdlib(tmp_path / "lib"), cache=tmp_path / "cache")


def test_fake_root_listing_excludes_tests_and_site_packages(tmp_path):
    files = data.stdlib_files(_fake_stdlib(tmp_path / "lib"))
    assert files == sorted(files) and len(files) == 20
    assert not any("test" in name or "site-packages" in name for name in files)


def test_fake_corpus_splits_by_file_and_round_trips_bytes(tmp_path, fake_corpus):
    root = tmp_path / "lib"
    val_names = ["pkg/m1.py", "pkg/m12.py", "pkg/m5.py", "pkg/m6.py"]  # sorted
    assert fake_corpus.meta["val_files"] == val_names
    expected_val = b"".join((root / name).read_bytes() + b"\0" for name in val_names)
    assert fake_corpus.val.tobytes() == expected_val
    assert fake_corpus.meta["splits"]["train"] == {"files": 16, "bytes": len(fake_corpus.train)}
    assert b"SKIPPED" not in fake_corpus.train.tobytes() + fake_corpus.val.tobytes()


def test_corpus_is_cached_and_memory_mapped(tmp_path, fake_corpus, monkeypatch):
    assert isinstance(fake_corpus.train, np.memmap) and fake_corpus.train.dtype == np.uint8
    monkeypatch.setattr(data, "_read_split", lambda *a: pytest.fail("a cached corpus was rebuilt"))
    again = data.stdlib_corpus(tmp_path / "lib", cache=tmp_path / "cache")
    assert np.array_equal(again.train, fake_corpus.train)


def test_half_built_cache_is_rebuilt(tmp_path, fake_corpus):
    folder = tmp_path / "cache" / f"stdlib-{fake_corpus.meta['key']}"
    expected = fake_corpus.val.tobytes()
    (folder / "meta.json").unlink()
    (folder / "val.bin").write_bytes(b"garbage")
    rebuilt = data.stdlib_corpus(tmp_path / "lib", cache=tmp_path / "cache")
    assert rebuilt.val.tobytes() == expected


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("K3COURSE_CACHE", str(tmp_path / "here"))
    assert data.cache_dir() == tmp_path / "here"


def test_bad_roots_and_split_names_name_the_argument(tmp_path, fake_corpus):
    with pytest.raises(FileNotFoundError, match="root"):
        data.stdlib_files(tmp_path / "missing")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m0.py").write_text("x = 1\n")  # m0 is a training file: no validation split
    with pytest.raises(ValueError, match="too few"):
        data.stdlib_corpus(tmp_path / "one", cache=tmp_path / "cache")
    with pytest.raises(ValueError, match="name"):
        fake_corpus.split("test")


def test_real_stdlib_listing():
    files = data.stdlib_files()
    assert len(files) > 300 and files == sorted(files)
    assert "os.py" in files and "json/decoder.py" in files
    assert not any(set(name.split("/")[:-1]) & data.EXCLUDED_DIRS for name in files)
    share = sum(map(data.is_validation, files)) / len(files)
    assert 0.05 < share < 0.15


def test_batches_depend_only_on_seed_and_index(fake_corpus):
    tokens = fake_corpus.train
    inputs, targets = data.batch_at(tokens, index=3, batch_size=4, seq_len=16, seed=7)
    assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    again, _ = data.batch_at(tokens, index=3, batch_size=4, seq_len=16, seed=7)
    other, _ = data.batch_at(tokens, index=4, batch_size=4, seq_len=16, seed=7)
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    with pytest.raises(ValueError, match="seq_len"):
        data.batch_at(tokens[:10], index=0, batch_size=1, seq_len=16, seed=0)


def test_eval_windows_tile_without_overlap(fake_corpus):
    windows = data.eval_windows(fake_corpus.train, seq_len=8, n_bytes=None)
    assert windows.shape == ((len(fake_corpus.train) - 1) // 8, 9)
    flat = torch.from_numpy(np.asarray(fake_corpus.train).astype(np.int64))
    assert torch.equal(windows[1], flat[8:17])
    assert data.eval_windows(fake_corpus.train, seq_len=8, n_bytes=40).shape == (5, 9)


def test_ngram_bits_per_byte_by_hand():
    train = np.frombuffer(b"abab", dtype=np.uint8)
    val = np.frombuffer(b"ab", dtype=np.uint8)
    unigram = -0.5 * (2 * math.log2((2 + 0.1) / (4 + 25.6)))
    assert data.ngram_bits_per_byte(train, val, 1) == pytest.approx(unigram)
    # bigram: the history 'a' was followed by 'b' twice in train: P(b | a) = (2 + k) / (2 + 256 k)
    assert data.ngram_bits_per_byte(train, val, 2) == pytest.approx(-math.log2(2.1 / 27.6))
    with pytest.raises(ValueError, match="order"):
        data.ngram_bits_per_byte(train, val, 4)


def test_ngrams_improve_with_order_and_lzma_compresses(fake_corpus):
    scores = data.baselines(fake_corpus)
    assert scores["unigram"] > scores["bigram"] > scores["trigram"]
    assert 0 < scores["lzma-9"] < 8
    assert data.baselines(fake_corpus) == scores  # read back from its cache file


def test_hard_mqar_has_more_pairs_than_the_head_dimension():
    tokens, targets = data.mqar_hard(8, seed=0)
    assert tokens.shape == targets.shape == (8, data.HARD_MQAR["seq_len"])
    assert data.HARD_MQAR["n_pairs"] > 32  # tiny preset's kda_head_dim
    asked = targets != data.IGNORE
    assert torch.equal(asked.sum(1), torch.full((8,), data.HARD_MQAR["n_pairs"]))
    keys, values = tokens[0, 0:80:2], tokens[0, 1:80:2]
    lookup = dict(zip(keys.tolist(), values.tolist()))
    assert all(lookup[k] == v for k, v in zip(tokens[0][asked[0]].tolist(), targets[0][asked[0]].tolist()))


# --- your own text ------------------------------------------------------------------------------------------

def _texts(folder, count=30):
    """``count`` small text files (several fall in validation by the hash rule), a hidden file, a binary one."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"n{i}.txt").write_text(f"note {i}: the cat sat on the mat.\n" * (3 + i))
    (folder / ".hidden.txt").write_text("HIDDEN\n")
    (folder / "image.bin").write_bytes(b"\x89PNG\x00\x01BINARY")
    return folder


def test_text_corpus_splits_your_files_by_their_path_inside_the_folder(tmp_path):
    corpus = data.text_corpus([str(_texts(tmp_path / "notes"))], cache=tmp_path / "cache")
    names = [f"n{i}.txt" for i in range(30)]
    val_names = sorted(name for name in names if data.is_validation(name))
    assert 0 < len(val_names) < 30
    assert [Path(p).name for p in corpus.meta["val_files"]] == val_names
    text = corpus.train.tobytes() + corpus.val.tobytes()
    assert b"HIDDEN" not in text and b"BINARY" not in text
    expected_val = b"".join((tmp_path / "notes" / name).read_bytes() + b"\0" for name in val_names)
    assert corpus.val.tobytes() == expected_val and corpus.meta["splits"]["train"]["files"] == 30 - len(val_names)
    again = data.text_corpus([str(tmp_path / "notes")], cache=tmp_path / "cache")
    assert again.meta["key"] == corpus.meta["key"] and isinstance(again.train, np.memmap)
    (tmp_path / "notes" / "n0.txt").write_text("edited\n")
    assert data.text_corpus([str(tmp_path / "notes")], cache=tmp_path / "cache").meta["key"] != corpus.meta["key"]


def test_text_files_take_files_folders_and_globs_each_once(tmp_path, monkeypatch):
    _texts(tmp_path / "a" / "deep")
    (tmp_path / "b.md").write_text("# b\n")
    monkeypatch.chdir(tmp_path)
    found = data.text_files(["a/**/n1*.txt", "b.md", "a"])
    keys = [key for _, key in found]
    assert keys[:11] == ["deep/n1.txt"] + [f"deep/n1{i}.txt" for i in range(10)]  # below the glob's fixed folder
    assert "b.md" in keys and len(found) == len({path for path, _ in found}) == 31
    assert all(path.is_absolute() for path, _ in found)


def test_val_files_replace_the_hash_split(tmp_path):
    corpus = data.text_corpus([str(_texts(tmp_path / "train"))], val=[str(_texts(tmp_path / "held", 2))],
                              cache=tmp_path / "cache")
    assert corpus.meta["splits"]["train"]["files"] == 30 and corpus.meta["splits"]["val"]["files"] == 2
    with pytest.raises(ValueError, match="val: .* is also named by data"):
        data.text_corpus([str(tmp_path / "train")], val=[str(tmp_path / "train" / "n3.txt")], cache=tmp_path)


def test_bad_text_input_is_named(tmp_path, monkeypatch):
    _texts(tmp_path / "notes")
    cases = [(["missing/"], FileNotFoundError, "data: no file or folder at 'missing/'"),
             (["notes/*.csv"], FileNotFoundError, "data: nothing matches 'notes/\\*.csv'"),
             (["notes/image.bin"], ValueError, "data: notes/image.bin is not text"),
             ("notes", ValueError, "data: expected a list")]
    monkeypatch.chdir(tmp_path)
    for paths, error, message in cases:
        with pytest.raises(error, match=message):
            data.text_corpus(paths, cache=tmp_path / "cache")
    (tmp_path / "one.txt").write_text("x = 1\n")  # its name falls in training: no validation file
    with pytest.raises(ValueError, match="give no validation file .* --val"):
        data.text_corpus(["one.txt"], cache=tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    for i in range(30):
        (tmp_path / "empty" / f"{i}.txt").write_text("")
    with pytest.raises(ValueError, match="data: the train files are all empty"):
        data.text_corpus(["empty"], cache=tmp_path / "cache")
    real_open = Path.open

    def locked_open(path, *args, **kwargs):  # n2.txt unreadable (a permission bit would not stop root)
        if path.name == "n2.txt":
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", locked_open)
    with pytest.raises(PermissionError, match="data: cannot read .*n2.txt \\(Permission denied\\)"):
        data.text_corpus(["notes"], cache=tmp_path / "cache")


def test_window_baselines_score_the_bytes_the_model_predicts():
    train = np.frombuffer(b"abcabcabcab", dtype=np.uint8)
    windows = np.frombuffer(b"xabcyabc", dtype=np.uint8).reshape(2, 4)
    scores = data.window_baselines(train, windows)
    assert scores["unigram"] == pytest.approx(data.ngram_bits_per_byte(train, windows[:, 1:].reshape(-1), 1))
    bigram_pairs = np.concatenate([windows[:, 0:2], windows[:, 1:3], windows[:, 2:4]])
    assert scores["bigram"] == pytest.approx(data.ngram_bits_per_byte(train, bigram_pairs, 2))
    assert 0 < scores["lzma-9"]
