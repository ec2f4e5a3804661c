"""Chunkwise KDA's forward from three functions (chapter 08's three KDA exercises: the intra-chunk factors, the
state pass, the output), composed by ``kda_chunk_from_kernels``: equal to the package's chunk op and run inside
the model as its ``kda_chunk`` part. The package's own three steps stand in for a learner's here; the solutions
notebook composes the learner's the same way."""

from __future__ import annotations

import pytest
import torch

from k3course.config import K3Config
from k3course.kernels.kda_chunk import kda_chunk_from_kernels
from k3course.model import K3Model
from k3course.ops import kda_chunk
from k3course.parts import use_parts


def inputs(B, T, H, K, V, seed, below=-6.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = below * torch.rand(B, T, H, K, generator=gen)  # down to −6: below K3's bound of −5, which clamps it
    return q, k, v, g, torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen)


def relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("T, K, V, chunk", [(37, 16, 24, 16), (45, 20, 12, 32)])
def test_three_steps_composed_equal_the_chunk_op(T, K, V, chunk):
    q, k, v, g, beta, h0 = inputs(2, T, 2, K, V, seed=T)
    composed = kda_chunk_from_kernels()
    for bound in (None, -5.0):
        got, got_state = composed(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                  chunk_size=chunk, lower_bound=bound)
        want, want_state = kda_chunk(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                     chunk_size=chunk, lower_bound=bound)
        assert relative(got, want) <= 1e-5 and relative(got_state, want_state) <= 1e-5


def test_composed_op_runs_as_the_models_kda_chunk_part():
    torch.manual_seed(0)
    model = K3Model.from_config(K3Config.preset("tiny")).eval()
    tokens = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))  # > one chunk: chunked
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["lower_bound"])
        return kda_chunk_from_kernels()(*args, **kwargs)

    with torch.no_grad():
        want = model(tokens)[0]
        with use_parts(kda_chunk=counted):
            got = model(tokens)[0]
    assert calls and all(bound is not None for bound in calls)  # K3's bounded gate reaches the part
    assert relative(got, want) <= 1e-5


def test_composed_op_refuses_negative_eigenvalues():
    q, k, v, g, beta, _ = inputs(1, 5, 1, 16, 16, seed=3)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        kda_chunk_from_kernels()(q, k, v, g, beta, allow_neg_eigval=True)


def test_the_capstone_composes_chapter_08s_kernels_from_a_notebook():
    """capstone.your_kda_chunk reads the three kernels (each a @triton.jit kernel and its launcher, defined in a
    notebook cell) from the unsolved exercises' fallback, the solutions, and the composed op equals the chunk op."""
    from helpers import ROOT

    from k3course.lessons import capstone

    op, where = capstone.your_kda_chunk(root=ROOT)
    assert str(where) == "solutions/08_triton_exercises.ipynb"  # the committed exercises are stubs
    q, k, v, g, beta, h0 = inputs(1, 20, 1, 16, 16, seed=4)
    got, _ = op(q, k, v, g, beta, initial_state=h0, chunk_size=16, lower_bound=-5.0)
    want, _ = kda_chunk(q, k, v, g, beta, initial_state=h0, chunk_size=16, lower_bound=-5.0)
    assert relative(got, want) <= 1e-5
