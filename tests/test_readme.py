"""The README's Python example runs as written, and its two commands are the ones CI and learners use."""

from __future__ import annotations

import re

from helpers import ROOT

README = (ROOT / "README.md").read_text()


def test_python_example_runs(capsys):
    (example,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    exec(compile(example, "README.md", "exec"), {})
    assert "T total" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in README and "test-command" in ci
    (command,) = re.findall(r"<!-- test-command -->\n```bash\n(.*?)\n```", README, flags=re.S)
    assert command.count("\n") == 0 and "pip install torch==2.13.0 &&" in command and "pytest" in command


def test_course_map_is_one_table_of_every_chapter():
    """Rendered as markdown, the course map is one table whose rows are chapters 00 to 14, in order."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse(README)
    tables = [i for i, token in enumerate(tokens) if token.type == "table_open"]
    header_cells = [tokens[i + 4].content for i in tables]  # table_open thead_open tr_open th_open inline
    (start,) = [i for i, cell in zip(tables, header_cells) if cell == "#"]
    end = next(i for i in range(start, len(tokens)) if tokens[i].type == "table_close")
    body = tokens[next(i for i in range(start, end) if tokens[i].type == "tbody_open"):end]
    first_cells = [body[i + 2].content for i, token in enumerate(body) if token.type == "tr_open"]
    assert first_cells == [f"{n:02d}" for n in range(15)], first_cells


def test_course_map_runtimes_are_the_lessons_own():
    """The course map's runtime column says what each lesson's first cell says ("~1.5 min" ↔ "about 1.5 min")."""
    import nbformat
    from helpers import notebooks

    rows = re.findall(r"^\| (\d\d) \|.*\| ~([\d.]+ (?:s|min)) \|$", README, flags=re.M)
    assert [number for number, _ in rows] == [f"{n:02d}" for n in range(15)], rows
    for (_, runtime), path in zip(rows, notebooks("notebooks")):
        header = nbformat.read(path, 4).cells[0].source
        stated = re.search(r"Runtime on a 2-core CPU: about ([\d.]+ (?:s|min))\b", header)
        assert stated and stated.group(1) == runtime, f"{path.name}: {stated and stated.group(1)!r}, README ~{runtime}"
