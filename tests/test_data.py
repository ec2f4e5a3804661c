"""The stdlib byte corpus (built from a fake root in tmp_path, and the real listing), batches, baselines, MQAR."""

from __future__ import annotations

import math

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
