"""Helpers for the lesson notebooks: show the package's source instead of copying it, sliders that read well
before they run, the layer plan as a picture."""

from __future__ import annotations

import functools
import inspect

from IPython.display import Code


def show_source(obj) -> Code:
    """Display the source of a package function, class or module, syntax-highlighted."""
    try:
        return Code(inspect.getsource(obj), language="python")
    except TypeError as error:
        raise TypeError(f"obj must be a function, class or module of k3course, got {type(obj).__name__}") from error


def sliders(function, **controls) -> None:
    """``ipywidgets.interact(function, **controls)``, shown so that a learner can read it before running it.

    Every control's label gets the width it needs (long parameter names are not cut to "kda_per_…"), and where
    the widget cannot be drawn (a notebook opened before its cells run, a code host) the cell shows one plain line
    naming the controls instead of the widget's repr ("interactive(children=(IntSlider(…").
    """
    from IPython.display import display

    for control in controls.values():
        style = getattr(control, "style", None)
        if style is not None and hasattr(style, "description_width"):
            style.description_width = "initial"
    display(_sliders_class()(function, **controls))


@functools.cache
def _sliders_class():
    from ipywidgets import interactive

    class Sliders(interactive):
        """An ``interactive`` whose plain-text form says what it is (see :func:`sliders`)."""

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            names = ", ".join(child.description for child in self.kwargs_widgets)
            bundle["text/plain"] = f"[interactive: {names}; run this cell to move them]"
            return bundle

    return Sliders


LAYER_COLOURS = {"KDA mixer": "tab:blue", "MLA mixer": "tab:orange", "dense FFN": "lightgrey", "MoE FFN": "tab:green",
                 "AttnRes block (even)": "thistle", "AttnRes block (odd)": "rebeccapurple"}


def plot_layer_schedule(cfg, ax=None, legend: bool = True):
    """The layer plan of a K3Config as a picture: one row per decoder layer, columns mixer | FFN | AttnRes block.

    Colours in :data:`LAYER_COLOURS` (a legend under the plot says them); the third column shades the Block AttnRes
    block each layer's two sub-layers write into, alternating light and dark (blocks count sub-layers:
    ``cfg.attnres_block_size``; empty under PreNorm). In a plot too tall to label every layer, each dense layer
    gets an arrow, so a single dense row is not lost among the MoE rows.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    mixers, ffns = cfg.layer_types(), cfg.ffn_types()
    blocks = [2 * layer // cfg.attnres_block_size for layer in range(cfg.n_layers)]
    codes = [[("kda", "mla").index(m), 2 + ("dense", "moe").index(f),
              4 + block % 2 if cfg.residual == "block_attnres" else 6] for m, f, block in zip(mixers, ffns, blocks)]
    colours = [*LAYER_COLOURS.values(), "white"]
    if ax is None:
        _, ax = plt.subplots(figsize=(3.2, max(2.0, 0.22 * cfg.n_layers)))
    ax.imshow(codes, cmap=ListedColormap(colours), vmin=0, vmax=6, aspect="auto", interpolation="nearest")
    labelled = cfg.n_layers <= 16
    if cfg.residual == "block_attnres" and labelled:
        for layer, block in enumerate(blocks):
            ax.text(2, layer, f"block {block}", ha="center", va="center", fontsize=7, color="w" if block % 2 else "k")
    if not labelled:
        for layer in (i for i, f in enumerate(ffns) if f == "dense"):
            ax.annotate(f"layer {layer}: dense FFN", xy=(1, layer), xytext=(1, layer + 0.12 * cfg.n_layers),
                        ha="center", fontsize=7, arrowprops=dict(arrowstyle="->", lw=0.8),
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", lw=0.5))
    ax.set_xticks([0, 1, 2], ["mixer", "FFN", "AttnRes block"])
    if labelled:
        ax.set_yticks(range(cfg.n_layers))
    ax.set_ylabel("layer")
    ax.set_title(f"{cfg.name}: {mixers.count('kda')} KDA + {mixers.count('mla')} MLA", fontsize=9)
    if legend and not ax.figure.legends:
        ax.figure.legend(handles=[Patch(color=c, label=name) for name, c in LAYER_COLOURS.items()], loc="lower center",
                         ncol=len(LAYER_COLOURS), fontsize=8, frameon=False)
    return ax
