"""Independent check: our KDA / GDN ops against fla's naive PyTorch references, which this repo
did not write. Skips cleanly without the ``oracle`` extra (``pip install -e .[oracle]``)."""

from __future__ import annotations

import pytest
from test_kda import assert_close, inputs

from k3course.ops import gdn_chunk, gdn_recurrent, kda_chunk, kda_recurrent

pytest.importorskip("fla")
kda_naive = pytest.importorskip("fla.ops.kda.naive")
gdn_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")


@pytest.mark.parametrize("T", [1, 64, 100])
def test_kda_against_fla_naive(T):
    q, k, v, g, beta, s0 = inputs(T, seed=20 + T, g_low=-5.0)
    o_fla, s_fla = kda_naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    for op in (kda_recurrent, kda_chunk):
        o, s = op(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        assert_close(o, o_fla, 1e-4, f"{op.__name__} o"), assert_close(s, s_fla, 1e-4, f"{op.__name__} state")


def test_kda_chunk_against_fla_naive_chunk():
    q, k, v, g, beta, s0 = inputs(128, seed=30)
    o_fla, s_fla = kda_naive.naive_chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                             chunk_size=64)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=64)
    assert_close(o, o_fla), assert_close(s, s_fla)


@pytest.mark.parametrize("T", [1, 70])
def test_gdn_against_fla_naive(T):
    q, k, v, g, beta, s0 = inputs(T, seed=40 + T, scalar_gate=True)
    # fla's naive recurrent GDN takes (q, k, v, beta, g): beta before g
    o_fla, s_fla = gdn_naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=s0.clone(),
                                                              output_final_state=True)
    o_fla_chunk, _ = gdn_naive.naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64,
                                                            initial_state=s0.clone(), output_final_state=True)
    assert_close(o_fla_chunk, o_fla, 1e-4, "fla chunk vs fla recurrent")
    for op in (gdn_recurrent, gdn_chunk):
        o, s = op(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        assert_close(o, o_fla, 1e-4, f"{op.__name__} o"), assert_close(s, s_fla, 1e-4, f"{op.__name__} state")
