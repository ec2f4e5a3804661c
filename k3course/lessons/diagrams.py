"""Diagrams the lessons draw with matplotlib: boxes for operations, arrows for data.

- :func:`decoder_layer`     one K3 decoder layer: AttnRes reads, a KDA or gated-MLA mixer, the latent MoE;
- :func:`chunkwise_flow`    the chunkwise KDA algorithm: what is batched over all chunks, what loops over them;
- :func:`attnres_blocks`    Block AttnRes wiring: which sources each layer's read attends over;
- :func:`sort_dispatch`     sort-based MoE dispatch: slots sorted by expert, one GEMM per block, unsorted back;
- :func:`all_to_all_buffers` an uneven all-to-all: the P × P matrix of send counts, each rank's buffers before and
                            after.

Each returns the :class:`matplotlib.figure.Figure` (shown inline by Jupyter).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

COLORS = {"data": "#e8eef7", "mix": "#fde2c8", "ffn": "#d7efd9", "norm": "#f1f1f1", "route": "#f6d5e5",
          "state": "#fff3b0"}


def _canvas(width: float, height: float, title: str):
    """A figure with one axis in data units (1 unit = 1 inch), no ticks."""
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.set_title(title, fontsize=11)
    return fig, ax


def _box(ax, x: float, y: float, text: str, kind: str = "data", width: float = 1.6, height: float = 0.5):
    """A rounded box centred at (x, y); returns (x, y, width, height)."""
    ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.04",
                                facecolor=COLORS[kind], edgecolor="#555555", linewidth=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=8)
    return x, y, width, height


def _edge(box: tuple, towards: tuple) -> tuple[float, float]:
    """Where the line from ``box``'s centre to ``towards``'s centre leaves the box."""
    x, y, width, height = box
    dx, dy = towards[0] - x, towards[1] - y
    if dx == dy == 0:
        return x, y
    scale = min(width / 2 / abs(dx) if dx else float("inf"), height / 2 / abs(dy) if dy else float("inf"))
    return x + dx * scale, y + dy * scale


def _arrow(ax, start: tuple, end: tuple, bend: float = 0.0):
    """An arrow from box ``start`` to box ``end``, edge to edge."""
    ax.add_patch(FancyArrowPatch(_edge(start, end), _edge(end, start), arrowstyle="-|>", mutation_scale=9,
                                 color="#444444", linewidth=0.8, shrinkA=2, shrinkB=2,
                                 connectionstyle=f"arc3,rad={bend}"))


def decoder_layer():
    """One K3 decoder layer: AttnRes read → RMSNorm → KDA or gated MLA → write; read → RMSNorm → latent MoE → write.

    The mixer is one box: a layer runs KDA or gated MLA, never both (three layers in four KDA, the fourth MLA).
    """
    fig, ax = _canvas(8.6, 6.6, "One K3 decoder layer")
    stream = _box(ax, 4.3, 0.55, "the residual sources so far:\nembedding, completed block sums, partial sum",
                  width=4.4, height=0.62)
    read1 = _box(ax, 1.6, 1.75, "AttnRes read\n(query w_attn)", "route")
    norm1 = _box(ax, 1.6, 2.65, "RMSNorm", "norm")
    mixer = _box(ax, 1.6, 3.85, "token mixer, one of:\nKDA (3 layers in 4; state K×V)\nor gated MLA (1 in 4;\n"
                 "latent cache)", "mix", width=2.3, height=1.0)
    write1 = _box(ax, 1.6, 5.1, "write: add to the\ncurrent block sum", "route", width=1.9)
    read2 = _box(ax, 5.5, 1.75, "AttnRes read (query w_mlp),\nwhich also sees the mixer's write", "route",
                 width=2.7)
    norm2 = _box(ax, 5.5, 2.65, "RMSNorm", "norm")
    router = _box(ax, 3.95, 3.55, "router σ(W_r x)\n+ bias → top-k", "route", width=1.35)
    down = _box(ax, 5.5, 3.55, "W↓: d → ℓ", "ffn", width=1.2)
    experts = _box(ax, 5.5, 4.45, "k routed experts\n(SiTU-GLU, width ℓ)", "ffn", width=1.75)
    up = _box(ax, 5.5, 5.3, "RMSNorm, W↑: ℓ → d", "ffn", width=1.75)
    shared = _box(ax, 7.65, 4.45, "shared experts\n(full width d)", "ffn", width=1.4)
    write2 = _box(ax, 6.5, 6.15, "write: routed + shared", "route", width=2.2)
    for start, end in ((stream, read1), (read1, norm1), (norm1, mixer), (mixer, write1), (stream, read2),
                       (read2, norm2), (norm2, router), (norm2, down), (down, experts), (router, experts),
                       (experts, up), (up, write2), (norm2, shared), (shared, write2)):
        _arrow(ax, start, end)
    return fig


def chunkwise_flow():
    """The chunkwise algorithm: steps 1–4 and 6 batched over every chunk, steps 5, 7, 8 along the state."""
    fig, ax = _canvas(8.0, 4.8, "Chunkwise KDA: batched over all chunks, then one pass of the state")
    inputs = _box(ax, 1.0, 4.0, "chunk c:\nq, k, v, g, β  [C, ·]", width=1.8, height=0.6)
    cumsum = _box(ax, 3.0, 4.0, "1. G = cumsum(g)\n(in the chunk)")
    scores = _box(ax, 5.0, 4.0, "2, 6. A_kk, A_qk\ne^{G_r − G_i} ≤ 1", width=1.8)
    ut = _box(ax, 7.0, 4.0, "3. UT transform\nM = (I + A_kk)⁻¹ Diag(β)", width=1.9)
    wy = _box(ax, 7.0, 2.9, "4. W = M(Γ⊙K)\n    U = M V", width=1.6)
    ax.text(4.0, 3.35, "all chunks at once (no state needed)", ha="center", fontsize=8, style="italic")
    state_in = _box(ax, 1.0, 1.6, "S entering\nchunk c", "state")
    correct = _box(ax, 3.4, 1.6, "5. Ṽ = U − W S", "state")
    output = _box(ax, 3.4, 2.7, "7. O = (Γ⊙Q) S + A_qk Ṽ", "mix", width=2.0)
    state_out = _box(ax, 5.6, 0.9, "8. S ← Diag(Γ_C) S\n+ (K⊙e^{G_C−G})ᵀ Ṽ", "state", width=2.0, height=0.6)
    following = _box(ax, 7.4, 0.9, "chunk c + 1", "state", width=1.0)
    for start, end in ((inputs, cumsum), (cumsum, scores), (scores, ut), (ut, wy), (wy, correct),
                       (state_in, correct), (correct, output), (correct, state_out), (state_out, following)):
        _arrow(ax, start, end)
    ax.text(1.0, 0.35, "T / C sequential steps, each a few matrix products", fontsize=8, style="italic")
    return fig


def attnres_blocks(n_layers: int = 6, block_size: int = 2):
    """Block AttnRes: each sub-layer reads softmax-weighted [embedding, completed block sums, partial sum]."""
    if n_layers < 1 or block_size < 1:
        raise ValueError(f"n_layers and block_size must be ≥ 1, got {n_layers} and {block_size}")
    fig, ax = _canvas(1.4 + 1.15 * n_layers, 3.6, f"Block AttnRes: {n_layers} sub-layers in blocks of {block_size}")
    embedding = _box(ax, 0.7, 0.6, "embedding\nv₀", width=1.0)
    layers = [_box(ax, 1.7 + 1.15 * i, 2.9, f"sub-layer {i + 1}", "mix", width=0.95) for i in range(n_layers)]
    for start in range(0, n_layers, block_size):
        members = layers[start:start + block_size]
        block_x = (members[0][0] + members[-1][0]) / 2
        block = _box(ax, block_x, 1.6, f"block {start // block_size + 1} sum", "route", width=0.9 * len(members))
        for layer in members:
            _arrow(ax, layer, block)
    for i, layer in enumerate(layers):
        completed = i // block_size
        ax.text(layer[0], 2.35, f"reads {1 + completed + (i % block_size > 0)}", ha="center", fontsize=7,
                color="#7a3b69")
    _arrow(ax, embedding, layers[0], bend=0.2)
    ax.text(0.2, 0.05, "each read: embedding + completed block sums + the current block's partial sum (if any)",
            fontsize=7, style="italic")
    return fig


def sort_dispatch(expert_idx=((2, 0), (1, 2), (0, 1)), n_experts: int = 3):
    """Sort-based dispatch for a small routing: slots t·k + i, sorted by expert, one GEMM per expert block."""
    slots = [(token, choice, expert) for token, row in enumerate(expert_idx) for choice, expert in enumerate(row)]
    order = sorted(range(len(slots)), key=lambda s: slots[s][2])  # stable: equal experts keep slot order
    fig, ax = _canvas(7.5, 0.9 + 0.55 * len(slots), "Sort-based dispatch: slots sorted by expert, then unsorted")
    top = 0.55 * len(slots) + 0.3
    slot_boxes = [_box(ax, 1.3, top - 0.55 * s, f"slot {s}: token {token}, choice {choice} → e{expert}",
                       width=2.5, height=0.42) for s, (token, choice, expert) in enumerate(slots)]
    for row, s in enumerate(order):
        _box(ax, 4.0, top - 0.55 * row, f"row {row}: slot {s}", "route", width=1.3, height=0.42)
        right_of_slot, left_of_row = (2.6, slot_boxes[s][1], 0, 0), (3.3, top - 0.55 * row, 0, 0)
        _arrow(ax, right_of_slot, left_of_row)
    start = 0
    for expert in range(n_experts):
        count = sum(slots[s][2] == expert for s in order)
        if count:
            middle = top - 0.55 * (start + (count - 1) / 2)
            _box(ax, 5.7, middle, f"expert {expert}: one GEMM\non {count} rows", "ffn", width=1.6,
                 height=0.55 * count - 0.1)
        start += count
    ax.text(6.6, top - 0.55 * (len(slots) - 1) - 0.1, "unsort:\nout[order[r]] = y[r],\nthen weight and sum\nper token",
            fontsize=7, ha="left", va="bottom")
    return fig


def all_to_all_buffers(counts):
    """An uneven all-to-all from its send counts, counts[q][r] = rows rank q sends to rank r: the P × P matrix
    (row q = what rank q sends, column r = what rank r receives), and each rank's send buffer (blocks by
    destination, in rank order) above its receive buffer (blocks by source, in rank order), one colour a rank."""
    ranks = len(counts)
    if ranks < 1 or any(len(row) != ranks for row in counts):
        raise ValueError(f"counts must be a P × P list of lists, got {counts!r}")
    colors = plt.get_cmap("tab10")
    fig, (matrix, buffers) = plt.subplots(1, 2, figsize=(11, 0.9 + 0.75 * ranks),
                                          gridspec_kw={"width_ratios": [1, 3]})
    matrix.imshow(counts, cmap="Blues", vmin=0, vmax=2 * max(max(row) for row in counts) or 1)
    for q in range(ranks):
        for r in range(ranks):
            matrix.text(r, q, str(counts[q][r]), ha="center", va="center")
    matrix.set(xticks=range(ranks), yticks=range(ranks), xlabel="to rank r (receives the column)",
               ylabel="from rank q (sends the row)", title="send counts")
    widest = max(max(sum(row) for row in counts), max(sum(col) for col in zip(*counts)))
    for rank in range(ranks):
        send = [(r, counts[rank][r]) for r in range(ranks)]
        receive = [(q, counts[q][rank]) for q in range(ranks)]
        for level, blocks, word in ((0.42, send, "to"), (0.0, receive, "from")):
            start = 0
            y = ranks - 1 - rank + level
            for other, count in blocks:
                if count:
                    buffers.add_patch(plt.Rectangle((start, y), count, 0.36, color=colors(other), alpha=0.6))
                    buffers.text(start + count / 2, y + 0.18, f"{word} {other}: {count}", ha="center", va="center",
                                 fontsize=7)
                start += count
        buffers.text(-0.3, ranks - 1 - rank + 0.6, "send", ha="right", va="center", fontsize=7)
        buffers.text(-0.3, ranks - 1 - rank + 0.18, "receive", ha="right", va="center", fontsize=7)
    buffers.set(xlim=(-2.2, widest + 0.5), ylim=(-0.2, ranks), yticks=[r + 0.4 for r in range(ranks)],
                yticklabels=[f"rank {ranks - 1 - r}" for r in range(ranks)], xlabel="rows of the buffer",
                title="each rank's buffers: send (blocks by destination) and receive (blocks by source)")
    fig.tight_layout()
    return fig
