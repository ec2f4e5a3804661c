"""The README's Python example runs as written, its two commands are the ones CI and learners use, and every
``k3course`` command in its bash blocks runs (training shortened by the rule in :func:`shortened`)."""

from __future__ import annotations

import math
import re
import shlex

import pytest
import torch
from helpers import ROOT

from k3course import data
from k3course.cli import main

README = (ROOT / "README.md").read_text()


def test_every_python_block_runs(capsys):
    """Each ```python block runs as written, in a fresh namespace; the first prints K3's size and an untrained
    model's next-byte loss near ln 256 (a copy task, targets = inputs, would not be what it claims)."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "T total" in out
    (loss,) = re.findall(r"next-byte loss ([0-9.]+) nats", out)
    assert abs(float(loss) - 5.55) < 0.5, out


def test_python_example_trains_next_byte_targets():
    """The example's targets are its inputs shifted by one byte: each position's target is the byte after it."""
    (first, *_) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert "targets=tokens" not in first and "text[:, 1:]" in first and "text[:, :-1]" in first


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in README and "test-command" in ci
    (command,) = re.findall(r"<!-- test-command -->\n```bash\n(.*?)\n```", README, flags=re.S)
    assert command.count("\n") == 0 and "pip install torch==2.13.0 &&" in command and "pytest" in command
    # the lessons and the solved exercise notebooks are checked against their stored outputs as checked out
    assert command.endswith("--nbval tests notebooks solutions"), command


def test_course_map_is_one_table_of_every_chapter():
    """Rendered as markdown, the course map is one table whose rows are the lessons in notebooks/, in order."""
    from helpers import notebooks
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse(README)
    tables = [i for i, token in enumerate(tokens) if token.type == "table_open"]
    header_cells = [tokens[i + 4].content for i in tables]  # table_open thead_open tr_open th_open inline
    (start,) = [i for i, cell in zip(tables, header_cells) if cell == "#"]
    end = next(i for i in range(start, len(tokens)) if tokens[i].type == "table_close")
    body = tokens[next(i for i in range(start, end) if tokens[i].type == "tbody_open"):end]
    first_cells = [body[i + 2].content for i, token in enumerate(body) if token.type == "tr_open"]
    assert first_cells == [path.name[:2] for path in notebooks("notebooks")], first_cells


def readme_commands() -> list[list[str]]:
    """Every line of a ```bash block that is a ``k3course`` command, as argv after ``k3course``, comments cut."""
    lines = [line for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S) for line in block.splitlines()]
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("k3course ")]


# The shortening rule: a training command trains 1/400 of its steps (--steps and --extend-to; 2 when it names
# none) on batches of 2 × 32 bytes, evaluated on 256; generation stops after 8 bytes; without a GPU, --device
# cuda is --device cpu. `k3course bench gpu` runs as written where there is no GPU (it prints its plan); on a GPU
# it would time the kernels for minutes, which tests/test_bench_gpu.py covers.
SHORT = ["--set", "train.batch_size=2", "train.seq_len=32", "train.eval_bytes=256", "train.warmup_steps=1"]


def shortened(argv: list[str]) -> list[str] | None:
    """The README command ``argv`` as the test runs it (None: not run here, see the rule above)."""
    argv = list(argv)
    if argv[:2] == ["bench", "gpu"]:
        return None if torch.cuda.is_available() else argv
    for flag, short in (("--steps", lambda n: max(1, n // 400)), ("--extend-to", lambda n: max(1, n // 400)),
                        ("--max-new-tokens", lambda n: 8)):
        if flag in argv:
            at = argv.index(flag) + 1
            argv[at] = str(short(int(argv[at])))
    if "--device" in argv and not torch.cuda.is_available():
        argv[argv.index("--device") + 1] = "cpu"
    if argv[0] == "train":
        named = {"--steps", "--extend-to", "--resume", "--print-config"} & set(argv)
        ranks = math.prod(int(argv[argv.index(flag) + 1]) for flag in ("--ep", "--dp-shard") if flag in argv)
        argv += SHORT + ([f"train.batch_size={max(2, ranks)}"] if ranks > 2 else [])  # a row per rank at least
        argv += [] if named else ["--steps", "2"]
    return argv


def _your_data(folder) -> None:
    """The files the README's own-data commands name: notes/ (30 files, so both splits get some), papers/, held-out/."""
    for name, count in (("notes", 30), ("papers/2024", 3), ("held-out", 2)):
        (folder / name).mkdir(parents=True)
        for i in range(count):
            suffix = ".md" if name.startswith("papers") else ".txt"
            (folder / name / f"{i}{suffix}").write_text(f"note {i}: the cat sat on the mat.\n" * (20 + i))
    (toml,) = re.findall(r"```toml\n(.*?)```", README, flags=re.S)
    (folder / "run.toml").write_text(toml)


def test_every_k3course_command_in_the_readme_runs(tmp_path, monkeypatch, capsys, same_threads):
    stdlib = data.stdlib_corpus()  # the real cache, linked into a temporary one that also takes the README's data
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"stdlib-{stdlib.meta['key']}").symlink_to(data.cache_dir() / f"stdlib-{stdlib.meta['key']}")
    monkeypatch.setenv("K3COURSE_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    _your_data(tmp_path)
    commands = readme_commands()
    assert {argv[0] for argv in commands} >= {"train", "generate", "eval", "runs", "bench"}
    assert ["train", "--out", "runs/tiny", "--resume"] in commands and "--extend-to" in sum(commands, [])
    for argv in commands:
        run = shortened(argv)
        if run is None:
            continue
        code = main(run)
        assert code == 0, f"k3course {shlex.join(run)} exited {code}: {capsys.readouterr().err[-2000:]}"
    out = capsys.readouterr().out
    assert "new schedule tail" in out and "bits/byte" in out and (tmp_path / "runs.png").exists()


@pytest.mark.parametrize("argv, expected", [
    (["train", "--preset", "tiny", "--steps", "800", "--out", "r"], ["train", "--preset", "tiny", "--steps", "2",
                                                                     "--out", "r", *SHORT]),
    (["train", "--out", "r", "--extend-to", "1600"], ["train", "--out", "r", "--extend-to", "4", *SHORT]),
    (["train", "--preset", "small", "--device", "cuda"], ["train", "--preset", "small", "--device",
                                                          "cuda" if torch.cuda.is_available() else "cpu",
                                                          *SHORT, "--steps", "2"]),
])
def test_the_shortening_rule(argv, expected):
    assert shortened(argv) == expected


def test_course_map_runtimes_are_the_lessons_own():
    """The course map's runtime column says what each lesson's first cell says ("~1.5 min" ↔ "about 1.5 min")."""
    import nbformat
    from helpers import notebooks

    rows = re.findall(r"^\| (\d\d) \|.*\| ~([\d.]+ (?:s|min)) \|$", README, flags=re.M)
    assert [number for number, _ in rows] == [path.name[:2] for path in notebooks("notebooks")], rows
    for (_, runtime), path in zip(rows, notebooks("notebooks")):
        header = nbformat.read(path, 4).cells[0].source
        stated = re.search(r"Runtime on a 2-core CPU: about ([\d.]+ (?:s|min))\b", header)
        assert stated and stated.group(1) == runtime, f"{path.name}: {stated and stated.group(1)!r}, README ~{runtime}"


def _header_seconds(path) -> float:
    """The runtime a notebook's first cell states ("Runtime on a 2-core CPU: about 1.5 min"), in seconds."""
    import nbformat

    header = nbformat.read(path, 4).cells[0].source
    stated = re.search(r"Runtime on a 2-core CPU: about ([\d.]+) (s|min)\b", header)
    assert stated, f"{path.name}: its first cell states no runtime"
    return float(stated.group(1)) * (60 if stated.group(2) == "min" else 1)


def test_readme_runtime_totals_follow_the_notebooks_headers():
    """The README's sum for the lessons is the sum of their headers within a factor 1.25 (rounding to a whole
    minute), and its range for the solved exercise notebooks is exactly the range their headers state."""
    from helpers import notebooks

    (minutes,) = re.findall(r"the seventeen lessons together:\s+about (\d+) minutes", README)
    lessons = sum(_header_seconds(path) for path in notebooks("notebooks"))
    assert len(notebooks("notebooks")) == 17 and 1 / 1.25 <= int(minutes) * 60 / lessons <= 1.25, (minutes, lessons)
    ((low, high),) = re.findall(r"a solved exercise notebook runs in (\d+)–(\d+) s", README)
    exercises = [_header_seconds(path) for path in notebooks("exercises")]
    assert (float(low), float(high)) == (min(exercises), max(exercises)), exercises
