"""Gated MLA: NumPy and torch rungs agree; naive = absorbed = token-by-token; the cache is only the latent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3course import accounting
from k3course.accounting import (
    decode_step_flops,
    gqa_cache_numbers,
    kda_state_numbers,
    mha_cache_numbers,
    mla_cache_numbers,
)
from k3course.config import K3Config
from k3course.layers.mla import GatedMLA, YaRN, attend_sdpa, attend_softmax, rope_rotate
from k3course.reference import mla as ref

SMALL = dict(d_model=16, n_heads=3, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2,
             v_head_dim=5)


def make(seed: int = 0, dtype=torch.float64, **overrides) -> GatedMLA:
    torch.manual_seed(seed)
    return GatedMLA(**{**SMALL, **overrides}).to(dtype)


def numpy_weights(module: GatedMLA) -> dict:
    return {name: value.detach().double().numpy() for name, value in module.state_dict().items()}


def seeded_x(batch=2, length=7, seed=1, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(batch, length, SMALL["d_model"], generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("use_rope", [False, True])
def test_torch_matches_numpy_reference(gated, use_rope):
    module = make(gated=gated, use_rope=use_rope)
    x = seeded_x()
    y, cache = module(x)
    for b in range(x.shape[0]):
        y_ref, cache_ref = ref.gated_mla(x[b].numpy(), numpy_weights(module), SMALL["n_heads"],
                                         SMALL["qk_nope_head_dim"], SMALL["kv_lora_rank"], gated, use_rope)
        np.testing.assert_allclose(y[b].detach().numpy(), y_ref, rtol=1e-10, atol=1e-12)
        rows = torch.cat([cache.latent[b], cache.rope_key[b]], dim=-1).detach().numpy()
        np.testing.assert_allclose(rows, cache_ref, rtol=1e-10, atol=1e-12)


def test_fp32_torch_matches_fp64_reference():
    module = make(dtype=torch.float32)
    x = seeded_x(dtype=torch.float32)
    y, _ = module(x)
    assert y.dtype == torch.float32
    y_ref, _ = ref.gated_mla(x[0].double().numpy(), numpy_weights(module), 3, 4, 6)
    np.testing.assert_allclose(y[0].detach().double().numpy(), y_ref, rtol=1e-4, atol=1e-5)


def test_numpy_absorbed_equals_naive():
    module = make(use_rope=True)
    x = seeded_x()[0].numpy()
    naive, _ = ref.gated_mla(x, numpy_weights(module), 3, 4, 6, use_rope=True)
    absorbed, _ = ref.gated_mla(x, numpy_weights(module), 3, 4, 6, use_rope=True, absorbed=True)
    np.testing.assert_allclose(absorbed, naive, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("use_rope", [False, True])
def test_absorbed_and_naive_equal_the_full_forward(use_rope):
    module = make(use_rope=use_rope)
    x = seeded_x()
    full, _ = module(x)
    absorbed, _ = module(x, absorbed=True)
    torch.testing.assert_close(absorbed, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("use_rope", [False, True])
def test_token_by_token_decoding_equals_full_forward(absorbed, use_rope):
    module = make(use_rope=use_rope)
    x = seeded_x(length=9)
    full, full_cache = module(x)
    prefill, cache = module(x[:, :4])              # a prompt, then one token at a time
    outputs = [prefill]
    for t in range(4, 9):
        step, cache = module(x[:, t:t + 1], cache, absorbed=absorbed)
        outputs.append(step)
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cache.latent, full_cache.latent)
    torch.testing.assert_close(cache.rope_key, full_cache.rope_key)


def test_numpy_reference_decodes_with_its_cache():
    module = make()
    x, weights = seeded_x(length=6)[0].numpy(), numpy_weights(module)
    full, _ = ref.gated_mla(x, weights, 3, 4, 6)
    _, cache = ref.gated_mla(x[:3], weights, 3, 4, 6)
    rest, cache = ref.gated_mla(x[3:], weights, 3, 4, 6, cache=cache, absorbed=True)
    np.testing.assert_allclose(rest, full[3:], rtol=1e-12, atol=1e-13)
    assert cache.shape == (6, 6 + 2)


def test_causal_future_tokens_do_not_change_the_past():
    module = make()
    x = seeded_x()
    changed = x.clone()
    changed[:, 5:] += 1.0
    torch.testing.assert_close(module(changed)[0][:, :5], module(x)[0][:, :5])
    assert not torch.allclose(module(changed)[0][:, 5:], module(x)[0][:, 5:])


def test_scale_is_inverse_sqrt_of_nope_plus_rope():
    module = make()
    assert module.scale == pytest.approx((4 + 2) ** -0.5)
    x = seeded_x()
    y, _ = module(x)
    module.scale = 4 ** -0.5                       # the plausible mistake changes the output
    assert not torch.allclose(module(x)[0], y)


def test_cache_holds_only_latent_and_rope_key():
    module = make()
    _, cache = module(seeded_x(batch=2, length=5))
    assert cache.numbers_per_token == SMALL["kv_lora_rank"] + SMALL["qk_rope_head_dim"]
    assert (cache.latent.numel() + cache.rope_key.numel()) == 2 * 5 * (6 + 2)
    full_kv = SMALL["n_heads"] * (SMALL["qk_nope_head_dim"] + SMALL["qk_rope_head_dim"] + SMALL["v_head_dim"])
    assert cache.numbers_per_token < full_kv


def test_k3_size_cache_is_576_numbers_per_token():
    module = GatedMLA(7168, 96, 1536, 512, 128, 64, 128, device="meta")
    y, cache = module(torch.empty(1, 3, 7168, device="meta"))
    assert cache.numbers_per_token == 576 == mla_cache_numbers(512, 64)
    assert tuple(y.shape) == (1, 3, 7168)
    assert module.scale == pytest.approx(192 ** -0.5)


def test_ungated_has_no_gate_and_differs():
    gated, ungated = make(seed=3), make(seed=3, gated=False)
    assert ungated.gate is None
    x = seeded_x()
    assert not torch.allclose(gated(x)[0], ungated(x)[0])


def test_gradients_flow_to_every_parameter():
    module = make(dtype=torch.float32, use_rope=True)
    module(seeded_x(dtype=torch.float32))[0].square().mean().backward()
    for name, parameter in module.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_accounting_helpers():
    assert mha_cache_numbers(96, 128) == 2 * 96 * 128
    assert gqa_cache_numbers(8, 128, n_heads=64) == 2 * 8 * 128
    assert kda_state_numbers(2, 3, 4, conv_size=4) == 2 * 3 * 4 + 3 * 2 * (3 + 3 + 4)
    naive = decode_step_flops(1000, 96, 512, 128, 64, 128, absorbed=False)
    absorbed = decode_step_flops(1000, 96, 512, 128, 64, 128, absorbed=True)
    assert absorbed < naive / 50
    with pytest.raises(ValueError, match="n_heads=6 must be a multiple of n_kv_heads=4"):
        gqa_cache_numbers(4, 16, n_heads=6)


# --- bad input -----------------------------------------------------------------------------------------------

def test_heads_that_do_not_divide_are_rejected_by_the_reference():
    module = make()
    weights = numpy_weights(module)
    with pytest.raises(ValueError, match="q_up.weight has 18 rows, which do not divide into n_heads=4"):
        ref.gated_mla(seeded_x()[0].numpy(), weights, 4, 4, 6)


@pytest.mark.parametrize("overrides, message", [
    (dict(n_heads=0), "n_heads must be a positive int"),
    (dict(qk_rope_head_dim=3, use_rope=True), "qk_rope_head_dim must be even"),
    (dict(max_cache_len=0), "max_cache_len must be a positive int"),
])
def test_bad_sizes_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        GatedMLA(**{**SMALL, **overrides})


def test_sequence_longer_than_cache_limit():
    module = make(max_cache_len=8)
    _, cache = module(seeded_x(length=6))
    with pytest.raises(ValueError, match="6 cached \\+ 3 new tokens exceed max_cache_len=8"):
        module(seeded_x(length=3), cache)
    with pytest.raises(ValueError, match="exceed max_cache_len=8"):
        module(seeded_x(length=9))


def test_mismatched_cache_is_rejected():
    module = make()
    _, cache = module(seeded_x(batch=2))
    with pytest.raises(ValueError, match="cache does not match this layer and batch"):
        module(seeded_x(batch=3, length=1), cache)
    other = make(kv_lora_rank=7)
    with pytest.raises(ValueError, match="cache does not match"):
        other(seeded_x(batch=2, length=1), cache)
    with pytest.raises(ValueError, match="cache is torch.float64 .* x is torch.float32"):
        module.float()(seeded_x(batch=2, length=1, dtype=torch.float32), cache)
    with pytest.raises(TypeError, match="cache must be an MLACache"):
        make()(seeded_x(), torch.zeros(2, 7, 8, dtype=torch.float64))


def test_bad_x_shape():
    with pytest.raises(ValueError, match=r"x must be \[B, T, d_model=16\]"):
        make()(torch.zeros(7, 16, dtype=torch.float64))


def test_cache_is_preallocated_filled_in_place_and_grows_by_doubling():
    module = make().eval()
    x = seeded_x(batch=2, length=9)
    y_full, _ = module(x)
    cache = module.new_cache(2, max_len=4, dtype=torch.float64)
    buffer = cache._latent
    pieces = [module(x[:, :3], cache)[0]]
    assert cache._latent is buffer and cache.length == 3 and cache.capacity == 4  # filled in place
    for t in range(3, 9):
        y_t, returned = module(x[:, t:t + 1], cache)
        assert returned is cache
        pieces.append(y_t)
    assert cache.length == 9 and cache.capacity == 16  # 4 -> 8 -> 16
    np.testing.assert_allclose(torch.cat(pieces, 1).detach().numpy(), y_full.detach().numpy(), rtol=1e-10,
                               atol=1e-12)
    per_token = cache.numbers_per_token * 8  # fp64
    assert cache.nbytes() == 2 * 9 * per_token and cache.allocated_nbytes() == 2 * 16 * per_token


def test_full_rank_query_matches_reference():
    module = make(q_lora_rank=None)
    assert module.q_down is None
    x = seeded_x()
    y_ref, _ = ref.gated_mla(x[0].numpy(), numpy_weights(module), 3, 4, 6)
    np.testing.assert_allclose(module(x)[0][0].detach().numpy(), y_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_from_config_has_the_parameters_config_counts(preset):
    from k3course.accounting import mla_layer_params
    from k3course.config import K3Config

    cfg = K3Config.preset(preset)
    for config in (cfg, cfg.replace(q_lora_rank=None, mla_gated=False)):
        module = GatedMLA.from_config(config, device="meta")
        assert sum(p.numel() for p in module.parameters()) == mla_layer_params(config)


def test_bf16_returns_bf16_and_stays_close_to_fp32():
    module = make(dtype=torch.float32, use_rope=True)
    x = seeded_x(dtype=torch.float32)
    y32, _ = module(x)
    y16, cache16 = module.to(torch.bfloat16)(x.to(torch.bfloat16), absorbed=True)
    assert y16.dtype == cache16.latent.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, rtol=0.05, atol=0.05)


def test_kda_state_count_agrees_with_k3config():
    from k3course.config import K3Config

    k3 = K3Config.preset("kimi-k3")
    per_layer = kda_state_numbers(k3.kda_n_heads, k3.kda_head_dim, k3.kda_head_dim, k3.kda_conv_size)
    assert k3.n_kda_layers * per_layer * 2 == accounting.recurrent_state_bytes(k3, dtype_bytes=2, state_bytes=2)
    per_token = mla_cache_numbers(k3.kv_lora_rank, k3.qk_rope_head_dim)
    assert k3.n_mla_layers * per_token * 2 == accounting.kv_cache_bytes_per_token(k3)


# --- RoPE as DeepSeek's checkpoints use it: interleaved pairs, YaRN ----------------------------------------------

DEEPSEEK_LIKE = dict(use_rope=True, qk_rope_head_dim=8, yarn=YaRN(4.0, original_context=16, mscale=1.0,
                                                                  mscale_all_dim=0.8))


def test_interleaved_rope_is_half_split_rope_on_reordered_rope_rows():
    """Rotating pairs (2i, 2i + 1) equals rotating pairs (i, i + r/2) of weights whose rope rows (per head in W_UQ,
    and in W_DKV) are reordered [0, 2, 4, ..., 1, 3, 5, ...]: the layout is a property of the weights. Decoding
    from the cache gives the full forward's outputs."""
    interleaved, half = make(rope_interleaved=True, **DEEPSEEK_LIKE), make(**DEEPSEEK_LIKE)
    order = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    state = interleaved.state_dict()
    q_up = state["q_up.weight"].view(3, 4 + 8, -1)
    state["q_up.weight"] = torch.cat([q_up[:, :4], q_up[:, 4:][:, order]], 1).flatten(0, 1)
    state["kv_down.weight"] = torch.cat([state["kv_down.weight"][:6], state["kv_down.weight"][6:][order]])
    half.load_state_dict(state)
    x = seeded_x(length=9)
    full = interleaved(x)[0]
    torch.testing.assert_close(half(x)[0], full, rtol=1e-12, atol=1e-12)
    prefill, cache = interleaved(x[:, :5])
    steps = [interleaved(x[:, t:t + 1], cache, absorbed=True)[0] for t in range(5, 9)]
    torch.testing.assert_close(torch.cat([prefill, *steps], 1), full, rtol=1e-12, atol=1e-12)


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_rescales():
    yarn = YaRN(40.0, original_context=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    base = 1.0 / 10000.0 ** (torch.arange(32, dtype=torch.float64) / 32)
    freq = yarn.inv_freq(64, 10000.0, dtype=torch.float64)
    torch.testing.assert_close(freq[:10], base[:10])          # turn > 32 times over 4096 tokens: kept
    torch.testing.assert_close(freq[-8:], base[-8:] / 40)    # turn < once: interpolated by s
    assert yarn.rope_gain == 1.0 and yarn.score_gain == pytest.approx((1 + 0.1 * np.log(40)) ** 2)
    layer = GatedMLA.from_config(K3Config.preset("deepseek-v3"), device="meta")
    assert layer.use_rope and layer.rope_interleaved and layer.scale == pytest.approx(192 ** -0.5 * yarn.score_gain)
    x = torch.ones(1, 3, 2, 4)
    rotated = rope_rotate(x, torch.arange(3), yarn=YaRN(2.0, 16, mscale=1.0))  # rope_gain m(2, 1) on cos and sin
    assert torch.allclose(rotated[0, 0], x[0, 0] * (1 + 0.1 * np.log(2)))
    with pytest.raises(ValueError, match="yarn scales RoPE"):
        make(yarn=yarn)


# --- the naive path through SDPA equals the written-out softmax ----------------------------------------------

def run_with_prefix(module: GatedMLA, x: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed x's first ``prefix`` tokens, then the rest against their cache (gradients flow through both).

    Returns (the outputs of the last T − prefix tokens, the gradient of Σ y·w with respect to x) with the
    module's parameter gradients accumulated; w is a seeded weight, so every output matters."""
    x = x.detach().requires_grad_(True)
    cache = module(x[:, :prefix])[1] if prefix else None
    y, _ = module(x[:, prefix:], cache)
    weight = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float32).to(y.dtype)
    (y * weight).sum().backward()
    return y, x.grad


def assert_close_to_largest(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, name: str):
    """max |actual − expected| ≤ tolerance · max |expected| (in fp32)."""
    error = (actual.float() - expected.float()).abs().max().item()
    largest = expected.float().abs().max().item()
    assert error <= tolerance * largest, f"{name}: max |difference| {error:.3g} > {tolerance} x {largest:.3g}"


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("prefix, length", [(0, 9), (0, 1), (5, 4), (5, 6), (5, 1)])
def test_sdpa_equals_written_softmax_forward_and_backward(dtype, tolerance, use_rope, prefix, length):
    """The naive path through SDPA (default) and through attend_softmax: the same outputs and gradients (x and
    every parameter), causal prefill with and without a cache prefix, one token, RoPE and NoPE."""
    x = seeded_x(length=prefix + length, dtype=dtype)
    fused, written = (make(dtype=dtype, use_rope=use_rope, absorbed=False, sdpa=sdpa) for sdpa in (True, False))
    y_fused, dx_fused = run_with_prefix(fused, x, prefix)
    y_written, dx_written = run_with_prefix(written, x, prefix)
    assert y_fused.dtype == dtype
    assert_close_to_largest(y_fused, y_written, tolerance, "y")
    assert_close_to_largest(dx_fused, dx_written, tolerance, "dx")
    for (name, p_fused), p_written in zip(fused.named_parameters(), written.parameters()):
        assert_close_to_largest(p_fused.grad, p_written.grad, tolerance, name)


@pytest.mark.parametrize("nope, rope, value", [(4, 2, 5), (4, 2, 9), (6, 0, 6)])
@pytest.mark.parametrize("start, length", [(0, 7), (0, 1), (3, 5), (6, 1)])
def test_attend_sdpa_equals_attend_softmax(nope, rope, value, start, length):
    """The functions themselves, for value heads narrower than, wider than and as wide as q·k's, with no
    rope part, and with every mask case: causal, one token alone, a prefix (explicit mask), one token after it."""
    generator = torch.Generator().manual_seed(2)
    batch, heads, keys = 2, 3, start + length

    def sample(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)

    inputs = (sample(batch, length, heads, nope), sample(batch, length, heads, rope), sample(batch, keys, heads, nope),
              sample(batch, keys, rope), sample(batch, keys, heads, value))
    out_weight = torch.randn(batch, length, heads, value, generator=generator, dtype=torch.float64)
    results = []
    for attend in (attend_sdpa, attend_softmax):
        out = attend(*inputs, 0.3, start)
        results.append((out, *torch.autograd.grad((out * out_weight).sum(), inputs)))
    for fused, written in zip(*results):
        torch.testing.assert_close(fused, written, rtol=1e-12, atol=1e-12)


def test_sdpa_path_keeps_no_score_matrix_for_backward():
    """What autograd saves on the SDPA path holds no [T, S] scores per head: nothing as large as B·H·T·S
    (the written-out path keeps the probabilities, exactly that size)."""
    batch, length = 2, 64
    x = seeded_x(batch=batch, length=length, dtype=torch.float32)
    score_numbers = batch * SMALL["n_heads"] * length * length

    def largest_saved(module: GatedMLA) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            module(x)
        return max(sizes)

    assert largest_saved(make(dtype=torch.float32, sdpa=False)) >= score_numbers
    assert largest_saved(make(dtype=torch.float32, sdpa=True)) < score_numbers


def test_sdpa_flag_is_checked_and_reaches_from_config():
    with pytest.raises(TypeError, match="sdpa must be a bool"):
        make(sdpa="yes")
    cfg = K3Config.preset("tiny")
    assert GatedMLA.from_config(cfg, device="meta").sdpa
    assert not GatedMLA.from_config(cfg, device="meta", sdpa=False).sdpa

