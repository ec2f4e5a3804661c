"""Every K3 detail that reached the course second-hand carries the † marker, linked to its entry in
notebooks/references.md, in each paragraph of lessons 11–16 that states it (and the entries exist)."""

from __future__ import annotations

import re

import nbformat
import pytest
from helpers import ROOT

REFERENCES = (ROOT / "notebooks" / "references.md").read_text(encoding="utf-8")

# (what a paragraph says, the references.md entry its † must link to)
DETAILS = [
    (r"(?<!\d[.,])\b93\b(?![.,]\d)|\b69 KDA|\b24 MLA|24 of (?:K3's )?93|last layer is (?:always )?MLA"
     r"|ends with global attention", "k3-layers"),
    (r"dense (?:FFN )?layer|one dense|routing is unstable on the raw embedding", "k3-dense-layer"),
    (r"attnres_block_size = 24|blocks of 24|12 decoder layers per block", "k3-attnres-blocks"),
    (r"2\.78 ?T|2\.78-trillion|\b10[45] ?B active|10[45]B active", "k3-size"),
    (r"164 ?k vocabulary|163,?840", "k3-vocab"),
    (r"3584 of 7168|d = 7168|ℓ = 3584", "k3-width"),
    (r"96 heads × 128|96 heads of 128|96 × 128 × 128", "k3-kda"),
    (r"\b576\b|512 \+ 64|used by all 96 heads", "k3-mla"),
    (r"\b896\b(?! experts\) [^a-z])|16 of 896|sigmoid router|router σ", "k3-moe"),
    (r"SiTU-GLU", "k3-situ-glu"),
    (r"is replicated|replicated and data-parallel|super ?node of 64 GPUs", "k3-ep"),
    (r"75 ?% less|up to −?75 ?%|6\.3×", "kimi-linear-decoding"),
    (r"Table 1|perplexity 5\.65", "kimi-linear-table1"),
]
MARKER = re.compile(r"\[†\]\((?:\.\./notebooks/)?references\.md#([\w-]+)\)")
LESSONS = [ROOT / "notebooks" / name for name in
           ("11_model.ipynb", "12_train.ipynb", "13_expert_parallel.ipynb", "14_decoding.ipynb",
            "15_kimi_linear.ipynb", "16_capstone.ipynb")]


def paragraphs(path):
    """(cell index, paragraph) for each markdown paragraph of a notebook, HTML comments (quoted-number markers)
    and code spans removed."""
    for index, cell in enumerate(nbformat.read(path, 4).cells):
        if cell.cell_type != "markdown":
            continue
        text = re.sub(r"<!--.*?-->|`[^`]*`", "", cell.source, flags=re.S)
        for paragraph in re.split(r"\n\s*\n", text):
            yield index, paragraph


def unmarked(path) -> list[str]:
    problems = []
    for index, paragraph in paragraphs(path):
        anchors = set(MARKER.findall(paragraph))
        for pattern, anchor in DETAILS:
            found = re.search(pattern, paragraph)
            if found and anchor not in anchors:
                problems.append(f"cell {index}: {found.group(0)!r} without [†](references.md#{anchor})")
    return problems


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_every_second_hand_k3_detail_carries_the_marker(path):
    problems = unmarked(path)
    assert not problems, "\n".join(problems)


def test_a_detail_without_its_marker_is_caught(tmp_path):
    """The deliberate omission: a paragraph stating K3's 93 layers with no †, and one with the wrong †."""
    path = tmp_path / "lesson.ipynb"
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("K3 has 93 layers."),
        nbformat.v4.new_markdown_cell("K3 has 93 layers[†](references.md#k3-vocab)."),
        nbformat.v4.new_markdown_cell("K3 has 93 layers[†](references.md#k3-layers)."),
    ])
    nbformat.write(notebook, path)
    assert [problem.split(":")[0] for problem in unmarked(path)] == ["cell 0", "cell 1"]


def test_every_marker_in_the_course_links_to_an_entry():
    anchors = set(re.findall(r'<a id="([\w-]+)"></a>', REFERENCES))
    assert {anchor for _, anchor in DETAILS} <= anchors
    files = [*(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb"),
             *(ROOT / "exercises").glob("*.ipynb"), ROOT / "README.md"]
    linked = {anchor for path in files for anchor in MARKER.findall(path.read_text(encoding="utf-8"))}
    linked |= set(re.findall(r"references\.md#([\w-]+)", (ROOT / "README.md").read_text(encoding="utf-8")))
    assert linked and linked <= anchors, f"markers link to missing entries: {sorted(linked - anchors)}"


def test_the_marker_is_defined_once_where_the_course_starts():
    tour = nbformat.read(ROOT / "notebooks" / "00_tour.ipynb", 4)
    assert "A † marks a K3 detail" in tour.cells[0].source
    assert "marks a K3 detail from a secondary source or our own assumption" in REFERENCES
