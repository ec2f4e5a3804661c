"""The worked kernels of lessons 03 and 10 (k3course.kernels.worked_reads) against torch, under the interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3course.kernels import TRITON_MODE  # noqa: E402
from k3course.kernels.worked_reads import expert_load, prenorm_read  # noqa: E402
from k3course.moe.balancing import expert_load as expert_load_torch  # noqa: E402

DEVICE = torch.device("cuda" if TRITON_MODE == "native" else "cpu")


def test_prenorm_read_sums_strided_sources_with_partial_blocks():
    sources = torch.randn(10, 3, 2, 5, generator=torch.Generator().manual_seed(0)).permute(3, 1, 0, 2).to(DEVICE)
    assert sources.shape == (5, 3, 10, 2) and not sources.is_contiguous()  # 30 tokens in blocks of 4, D = 2
    torch.testing.assert_close(prenorm_read(sources), sources.sum(0))
    assert prenorm_read(sources[:, :, :0]).shape == (3, 0, 2)


def test_expert_load_counts_every_slot_once():
    idx = torch.randint(0, 7, (50, 3), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(expert_load(idx, 7), expert_load_torch(idx, 7))
    assert torch.equal(expert_load(idx[:0], 7), torch.zeros(7, dtype=torch.int64, device=DEVICE))
