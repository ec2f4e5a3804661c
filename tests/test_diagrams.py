"""The lessons' diagrams draw, and say what they show."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from k3course.lessons import diagrams  # noqa: E402


def _texts(figure) -> str:
    return " | ".join(text.get_text() for ax in figure.axes for text in ax.texts)


@pytest.mark.parametrize(("draw", "labels"), [
    (diagrams.decoder_layer, ["KDA", "gated MLA", "AttnRes read", "shared experts", "W↓"]),
    (diagrams.chunkwise_flow, ["UT transform", "Ṽ = U − W S", "chunk c + 1"]),
    (lambda: diagrams.attnres_blocks(6, 2), ["block 3 sum", "sub-layer 6", "reads 4"]),
    (diagrams.sort_dispatch, ["row 0: slot 1", "expert 2: one GEMM\non 2 rows"]),
    (lambda: diagrams.all_to_all_buffers([[1, 3], [2, 0]]), ["to 1: 3", "from 1: 2", "from 0: 3", "send"]),
])
def test_each_diagram_draws_its_parts(draw, labels):
    figure = draw()
    try:
        text = _texts(figure)
        for label in labels:
            assert label in text, f"{label!r} missing from the diagram"
    finally:
        plt.close(figure)


def test_attnres_blocks_rejects_an_empty_stack():
    with pytest.raises(ValueError, match="n_layers and block_size must be ≥ 1"):
        diagrams.attnres_blocks(0, 2)
