"""Every lesson's markdown renders in JupyterLab as its text says. Two ways it does not:

- **maths by accident**: JupyterLab pairs every unescaped "$" with the next one in the same paragraph and typesets
  what lies between as TeX, so "$3 per million ... and $15" shows as italic "3permillion...and" and a quoted-number
  marker between two dollars shows as "<!−−q:…−−>". A price is written "\\$3".
- **a paragraph cut by a marker**: a line that starts with "<!--" opens an HTML block (CommonMark), which ends the
  paragraph above it and shows the rest of that line as raw HTML, markdown unrendered ("*starts*" stays literal).
  A quoted-number marker never starts a line.

The maths is found the way JupyterLab's markdown renderer finds it (code spans and blocks first set aside; "$" or
"$$" opens, the same delimiter closes, a blank line abandons an open one, "\\$" is a dollar sign); a span is maths
by accident when it holds a marker or runs of plain words (two words of two or more letters in a row, outside
``\\text{…}`` and TeX commands)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import notebooks

CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
DELIMITERS = re.compile(r"\\[{}$]|\$\$?|(?:\n[ \t]*)+")
TEX_WORDS = re.compile(r"\\(?:text|mathrm|textrm|operatorname|mbox)\{[^}]*\}|\\[A-Za-z]+")
PROSE = re.compile(r"[A-Za-z]{2,}[ \t\n]+[A-Za-z]{2,}")
MARKER_LINE = re.compile(r" {0,3}<!--")


def math_spans(markdown: str) -> list[str]:
    """The text JupyterLab typesets as maths in one markdown cell: what lies between paired "$" or "$$"."""
    text = CODE.sub(lambda code: "@" * len(code[0]), markdown)
    spans, opened = [], None
    for token in DELIMITERS.finditer(text):
        if token[0].startswith("\\"):
            continue  # an escaped dollar or brace
        if token[0].startswith("$"):
            if opened is None:
                opened = token
            elif token[0] == opened[0]:
                spans.append(text[opened.end():token.start()])
                opened = None
        elif token[0].count("\n") >= 2:
            opened = None  # a blank line: the open "$" was a dollar sign after all
    return spans


def rendering_problems(markdown: str) -> list[str]:
    """What would not render as written: maths by accident and lines that start with a marker."""
    problems = [f"maths by accident: ${span[:70]}$" for span in math_spans(markdown)
                if "<!--" in span or PROSE.search(TEX_WORDS.sub(" ", span))]
    fenced = False
    for line in markdown.split("\n"):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and MARKER_LINE.match(line):
            problems.append(f"a line starts with a marker (it cuts its paragraph): {line[:70]}")
    return problems


def test_the_checker_finds_both_failures_and_passes_maths():
    assert rendering_problems("costs $3 per million input tokens and $15 per million output")
    assert rendering_problems("costs $<!--q:x|.2f-->0.29 and $<!--q:y|.2f-->0.52")
    assert rendering_problems("a sentence that\n<!--q:x-->3 breaks here")
    assert not rendering_problems("costs \\$3 per million input tokens and \\$15 per million output")
    assert not rendering_problems("the rate $3 \\cdot 10^{-3}$ and $\\max_j \\text{load}_j - 1$, `$HOME` and $d_s$")
    assert not rendering_problems("a price of $3\n\nand $15 in the next paragraph")
    assert not rendering_problems("at 1M tokens the hybrid holds <!--q:k|.1f-->27.4 GiB\n```\n<!--q:in code-->\n```")


LESSONS = notebooks("notebooks") + notebooks("solutions") + notebooks("exercises")


@pytest.mark.parametrize("path", LESSONS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_markdown_cell_renders_as_written(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    problems = [f"cell {index}: {problem}" for index, cell in enumerate(cells) if cell["cell_type"] == "markdown"
                for problem in rendering_problems("".join(cell["source"]))]
    assert not problems, "\n".join(problems)
