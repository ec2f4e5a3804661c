"""Host reads during an MoE forward: none on the sort-based path; the loop fallback reads the group ends once.

A host read (``.item()``, ``bool(t)``, ``int(t)``) is one ``aten._local_scalar_dense`` call; on a GPU each
stalls the stream. ``.tolist()`` reads a whole tensor without that op, so it is counted separately.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers import HostReads

from k3course.moe import LatentMoE, MoE


def host_reads(layer: MoE, x: torch.Tensor) -> tuple[int, int]:
    """(scalar host reads, ``Tensor.tolist`` calls) during ``layer(x)``."""
    tolist_calls = []
    original = torch.Tensor.tolist

    def counted_tolist(tensor):
        tolist_calls.append(tuple(tensor.shape))
        return original(tensor)

    with mock.patch.object(torch.Tensor, "tolist", counted_tolist), HostReads() as reads:
        layer(x)
    return reads.count, len(tolist_calls)


def build(kind: type[MoE], kernels: str, training: bool) -> MoE:
    layer = kind(32, 8, 2, n_shared_experts=1, expert_dim=16, balancing="quantile", kernels=kernels,
                 generator=torch.Generator().manual_seed(0))
    return layer.train(training)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("kind", [MoE, LatentMoE])
def test_the_grouped_gemm_path_reads_nothing_back(kind, training):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    layer = build(kind, "torch", training)
    assert host_reads(layer, torch.randn(2, 9, 32)) == (0, 0)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("kind", [MoE, LatentMoE])
def test_the_loop_fallback_reads_the_group_ends_once(kind, training):
    # routing, sorting, the record and the combine read nothing; the per-expert loop needs each expert's
    # row range as Python ints: one group_offsets.tolist() per forward (and no scalar reads)
    layer = build(kind, "loop", training)
    assert host_reads(layer, torch.randn(2, 9, 32)) == (0, 1)


def test_the_counter_sees_a_host_read():
    with HostReads() as reads:
        bool(torch.ones(3).sum() > 0)
    assert reads.count == 1
