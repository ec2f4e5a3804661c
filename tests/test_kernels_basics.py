"""The chapter-08 teaching kernels (``k3course.kernels.basics``) against torch, under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from k3course.kernels import TRITON_MODE
from k3course.kernels.basics import decayed_kk_tile, l2norm_rows, matmul, scale_add

DEVICE = torch.device("cuda" if TRITON_MODE == "native" else "cpu")


def seeded(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("n", [1, 63, 64, 130])
def test_scale_add_masks_the_ragged_last_block(n):
    x, y = seeded(n, seed=1), seeded(n, seed=2)
    torch.testing.assert_close(scale_add(x, y, -1.5), -1.5 * x + y)


@pytest.mark.parametrize("shape", [(1, 1), (5, 20), (3, 128)])
def test_l2norm_rows(shape):
    x = seeded(*shape)
    torch.testing.assert_close(l2norm_rows(x), x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt())


@pytest.mark.parametrize("shape", [(1, 1, 1), (20, 37, 18), (32, 16, 48)])
def test_matmul_loops_over_k(shape):
    M, K, N = shape
    a, b = seeded(M, K, seed=3), seeded(K, N, seed=4)
    torch.testing.assert_close(matmul(a, b), a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", [-0.05, -5.0])
def test_decayed_kk_tile_matches_the_direct_sum_without_overflow(step):
    k = seeded(64, 20, seed=5)
    gc = torch.full((64, 20), step, device=DEVICE).cumsum(0)  # G reaches −320 at g = −5: e^{−G} overflows
    tile = decayed_kk_tile(k, gc, row_start=32, col_start=16)
    pairwise = (gc[32:48, None, :] - gc[None, 16:32, :]).double().exp()  # [16, 16, K], exponents ≤ 0
    want = torch.einsum("rd,id,rid->ri", k[32:48].double(), k[16:32].double(), pairwise)
    assert torch.isfinite(tile).all()
    torch.testing.assert_close(tile.double(), want, rtol=1e-5, atol=1e-7)


def test_decayed_kk_tile_rejects_a_tile_on_or_above_the_diagonal():
    k = seeded(32, 16)
    with pytest.raises(ValueError, match="col_start"):
        decayed_kk_tile(k, torch.zeros_like(k), row_start=0, col_start=16)
