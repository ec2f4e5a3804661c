"""Plausible wrong answers for chapter 08, written in torch (the check compares outputs, not how they are made)."""

import torch


def l2norm_without_eps(x):
    return x / x.pow(2).sum(-1, keepdim=True).sqrt()  # a zero row becomes NaN


def l2norm_of_columns(x):
    return x / (x.pow(2).sum(0, keepdim=True) + 1e-6).sqrt()


def l2norm_divides_by_squared_norm(x):
    return x / (x.pow(2).sum(-1, keepdim=True) + 1e-6)


def cumsum_never_resets(g, chunk_size=64):
    return g.float().cumsum(1)


def cumsum_exclusive(g, chunk_size=64):
    parts = [part.cumsum(1) - part for part in g.float().split(chunk_size, dim=1)]
    return torch.cat(parts, dim=1)


def tile_factored_naively(k, gc, row_start, col_start, size=16):
    rows, cols = slice(row_start, row_start + size), slice(col_start, col_start + size)
    return (k[rows] * gc[rows].exp()) @ (k[cols] * torch.exp(-gc[cols])).T  # e^{-G} overflows at strong decay


def tile_exponent_flipped(k, gc, row_start, col_start, size=16):
    rows, cols = slice(row_start, row_start + size), slice(col_start, col_start + size)
    ref = gc[row_start]
    return (k[rows] * torch.exp(ref - gc[rows])) @ (k[cols] * torch.exp(gc[cols] - ref)).T


def tile_without_decay(k, gc, row_start, col_start, size=16):
    return k[row_start:row_start + size] @ k[col_start:col_start + size].T


WRONG = {
    "08.l2norm_rows": [l2norm_without_eps, l2norm_of_columns, l2norm_divides_by_squared_norm],
    "08.chunk_cumsum": [cumsum_never_resets, cumsum_exclusive],
    "08.kk_tile": [tile_factored_naively, tile_exponent_flipped, tile_without_decay],
}
