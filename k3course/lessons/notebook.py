"""Helpers for the lesson notebooks: show the package's source instead of copying it."""

from __future__ import annotations

import inspect

from IPython.display import Code


def show_source(obj) -> Code:
    """Display the source of a package function, class or module, syntax-highlighted."""
    try:
        return Code(inspect.getsource(obj), language="python")
    except TypeError as error:
        raise TypeError(f"obj must be a function, class or module of k3course, got {type(obj).__name__}") from error


def plot_layer_schedule(cfg, ax=None):
    """The layer plan of a K3Config as a picture: one row per decoder layer, columns mixer | FFN | AttnRes block.

    Mixers KDA (blue) / MLA (orange); FFNs dense (grey) / MoE (green); the third column shades the Block
    AttnRes block each layer's two sub-layers write into, alternating light and dark (blocks count sub-layers:
    ``cfg.attnres_block_size``; empty under PreNorm).
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    mixers, ffns = cfg.layer_types(), cfg.ffn_types()
    blocks = [2 * layer // cfg.attnres_block_size for layer in range(cfg.n_layers)]
    codes = [[("kda", "mla").index(m), 2 + ("dense", "moe").index(f),
              4 + block % 2 if cfg.residual == "block_attnres" else 6] for m, f, block in zip(mixers, ffns, blocks)]
    colours = ["tab:blue", "tab:orange", "lightgrey", "tab:green", "thistle", "rebeccapurple", "white"]
    if ax is None:
        _, ax = plt.subplots(figsize=(3.2, max(2.0, 0.22 * cfg.n_layers)))
    ax.imshow(codes, cmap=ListedColormap(colours), vmin=0, vmax=6, aspect="auto", interpolation="nearest")
    if cfg.residual == "block_attnres" and cfg.n_layers <= 16:
        for layer, block in enumerate(blocks):
            ax.text(2, layer, f"block {block}", ha="center", va="center", fontsize=7, color="w" if block % 2 else "k")
    ax.set_xticks([0, 1, 2], ["mixer", "FFN", "AttnRes block"])
    if cfg.n_layers <= 16:
        ax.set_yticks(range(cfg.n_layers))
    ax.set_ylabel("layer")
    ax.set_title(f"{cfg.name}: {mixers.count('kda')} KDA + {mixers.count('mla')} MLA", fontsize=9)
    return ax
