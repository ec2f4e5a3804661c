"""Lesson 08's worked examples (``k3course.kernels.worked``: kernels next to the exercises') against torch,
under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from k3course.kernels import TRITON_MODE
from k3course.kernels.worked import gdn_decode, matmul_nt, rms_norm_rows, scalar_gate_cumsum, segment_sums, silu
from k3course.ops import gdn_recurrent

DEVICE = torch.device("cuda" if TRITON_MODE == "native" else "cpu")


def seeded(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("n", [1, 63, 130])
def test_silu_masks_the_ragged_last_block(n):
    x = seeded(n, seed=1)
    torch.testing.assert_close(silu(x), torch.nn.functional.silu(x))


@pytest.mark.parametrize("width", [1, 20, 64])
def test_rms_norm_reads_strided_rows(width):
    wide, weight = seeded(5, width + 7, seed=2), seeded(width, seed=3)
    x = wide[:, 3:3 + width]  # rows width + 7 apart
    want = torch.nn.functional.rms_norm(x, (width,), weight, eps=1e-6)
    torch.testing.assert_close(rms_norm_rows(x, weight), want)


@pytest.mark.parametrize("shape", [(1, 1, 1), (20, 37, 18), (33, 16, 40)])
def test_matmul_nt(shape):
    M, D, N = shape
    a, b = seeded(M, D, seed=4), seeded(N, D, seed=5)
    torch.testing.assert_close(matmul_nt(a, b), a @ b.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, chunk", [(1, 16), (37, 16), (70, 64)])
def test_scalar_gate_cumsum_restarts_every_chunk(T, chunk):
    g = -torch.rand(2, T, 3, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    padded = torch.nn.functional.pad(g, (0, 0, 0, -T % chunk))
    want = padded.reshape(2, -1, chunk, 3).cumsum(2).reshape(2, -1, 3)[:, :T]
    torch.testing.assert_close(scalar_gate_cumsum(g, chunk), want)


def test_gdn_decode_equals_the_recurrence_and_updates_the_state_in_place():
    B, T, H, K, V = 2, 3, 2, 20, 12
    q, v = seeded(B, T, H, K, seed=7), seeded(B, T, H, V, seed=8)
    k = torch.nn.functional.normalize(seeded(B, T, H, K, seed=9), dim=-1)
    g, beta = -3 * torch.rand(B, T, H).to(DEVICE), torch.rand(B, T, H).to(DEVICE)
    state = seeded(B, H, K, V, seed=10)
    want_o, want_state = gdn_recurrent(q, k, v, g, beta, scale=0.4, initial_state=state, output_final_state=True)
    o, same_state = gdn_decode(q, k, v, g, beta, state, scale=0.4)
    assert same_state is state
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("counts, dtype", [([5, 0, 40, 1, 0, 17], torch.int32), ([0, 3], torch.int64),
                                           ([0], torch.int32)])
def test_segment_sums_reads_the_ends_on_the_device_and_zeroes_empty_groups(counts, dtype):
    M = sum(counts)
    wide = seeded(M, 27, seed=7)
    x = wide[:, 2:22]  # rows 27 apart
    ends = torch.tensor(counts).cumsum(0).to(dtype=dtype, device=DEVICE)
    want = torch.stack([rows.sum(0) for rows in x.split(counts)])
    torch.testing.assert_close(segment_sums(x, ends), want, rtol=1e-5, atol=1e-5)
