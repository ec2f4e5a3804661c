"""The token mixers' common contract: the KDA layer against its fp64 NumPy reference (which catches the bugs a
layer could hide), bf16 prefill + decode with an fp32 state, no host reads in a forward, from_config, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3course.config import K3Config
from k3course.layers import kda as kda_module
from k3course.layers.kda import DecayedLinearAttention, GatedDeltaNet, KDACache, KimiDeltaAttention
from k3course.layers.mla import GatedMLA, MLACache
from k3course.reference.kda_layer import kda_layer, layer_weights

VARIANTS = {"K3": {}, "Kimi Linear": dict(lower_bound=None, output_gate="low_rank")}


def perturbed_kda(seed: int = 0, **kwargs) -> KimiDeltaAttention:
    """A small KDA layer whose gate rates and biases are away from their init (so every term matters)."""
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(24, 2, 8, chunk_size=16, **kwargs)
    with torch.no_grad():
        layer.A_log.normal_(0.0, 0.5)
        layer.dt_bias.normal_()
        layer.o_norm_weight.add_(0.2 * torch.randn_like(layer.o_norm_weight))
        layer.gate_proj.apply(lambda m: m.bias.normal_() if getattr(m, "bias", None) is not None else None)
    return layer


def reference_error(layer: KimiDeltaAttention, x: torch.Tensor) -> float:
    """max |layer(x) − NumPy fp64 reference| / max |reference|, on one sequence."""
    y = layer(x)[0][0].detach().double().numpy()
    want = kda_layer(x[0].double().numpy(), layer_weights(layer), layer.n_heads, layer.lower_bound)
    return float(np.abs(y - want).max() / np.abs(want).max())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_kda_layer_matches_its_numpy_reference(variant, mode):
    layer = perturbed_kda(mode=mode, **VARIANTS[variant])
    x = torch.randn(1, 37, 24, generator=torch.Generator().manual_seed(1))
    assert reference_error(layer, x) < 1e-5


class GateBiasOutsideTheRate(KimiDeltaAttention):
    def log_decay(self, x):
        z = self._heads(self.f_proj(x))
        return self.lower_bound * torch.sigmoid(self.A_log.exp()[:, None] * z + self.dt_bias)


class SiLUOutputGate(KimiDeltaAttention):
    def output_gate(self, x):
        return torch.nn.functional.silu(self.gate_proj(x))


def test_the_reference_catches_the_bugs_a_layer_could_hide(monkeypatch):
    x = torch.randn(1, 37, 24, generator=torch.Generator().manual_seed(2))
    for buggy in (GateBiasOutsideTheRate, SiLUOutputGate):
        torch.manual_seed(0)
        layer = buggy(24, 2, 8, chunk_size=16)
        layer.load_state_dict(perturbed_kda().state_dict())
        assert reference_error(layer, x) > 1e-3, buggy.__name__
    layer = perturbed_kda()
    monkeypatch.setattr(kda_module.F, "normalize", lambda t, dim: t)  # q and k without their L2 norm
    assert reference_error(layer, x) > 1e-3


class HostReads(TorchDispatchMode):
    """Counts device→host reads (aten._local_scalar_dense: .item(), bool(tensor), .tolist(), ...)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def tiny_mixers():
    cfg = K3Config.preset("tiny")
    torch.manual_seed(0)
    return {"kda": KimiDeltaAttention.from_config(cfg), "gdn": GatedDeltaNet.from_config(cfg),
            "decayed": DecayedLinearAttention.from_config(cfg), "mla": GatedMLA.from_config(cfg)}


@pytest.mark.parametrize("name", ["kda", "gdn", "decayed", "mla"])
def test_a_layer_forward_reads_nothing_back_to_the_host(name):
    layer = tiny_mixers()[name]
    x = torch.randn(2, 70, 128)
    for training, tokens in ((True, 70), (False, 70), (False, 5)):  # chunked / naive, prefill, short inference
        layer.train(training)
        with HostReads() as reads:
            _, cache = layer(x[:, :tokens])
            layer(x[:, :1], cache)  # one decode step
        assert reads.count == 0, f"{reads.count} host reads (training={training}, T={tokens})"


@pytest.mark.parametrize("name", ["kda", "mla"])
def test_bf16_prefill_then_decode_stays_near_fp32_and_the_state_stays_fp32(name):
    layer = tiny_mixers()[name].eval()
    x = torch.randn(2, 80, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference, _ = layer(x)
        low = tiny_mixers()[name].eval().to(torch.bfloat16)
        low.load_state_dict(layer.state_dict())
        y_prefill, cache = low(x[:, :70].bfloat16())
        steps = [y_prefill]
        for t in range(70, 80):
            y_t, cache = low(x[:, t:t + 1].bfloat16(), cache)
            steps.append(y_t)
    if isinstance(cache, KDACache):
        assert cache.state.dtype == torch.float32 and cache.conv_q.dtype == torch.bfloat16
    else:
        assert cache.latent.dtype == torch.bfloat16
    decoded = torch.cat(steps, 1).float()
    assert decoded.dtype == torch.float32 and torch.isfinite(decoded).all()
    assert ((decoded - reference).abs().max() / reference.abs().max()).item() < 3e-2  # bf16: 8 mantissa bits


def test_from_config_follows_the_config_choices():
    kimi_linear = K3Config.preset("kimi-linear-48b").replace(d_model=64, kda_n_heads=2, kda_head_dim=16)
    layer = KimiDeltaAttention.from_config(kimi_linear)
    assert layer.lower_bound is None and isinstance(layer.gate_proj, torch.nn.Sequential)
    k3 = KimiDeltaAttention.from_config(K3Config.preset("tiny"))
    assert k3.lower_bound == -5.0 and isinstance(k3.gate_proj, torch.nn.Linear)
    assert KimiDeltaAttention.from_config(K3Config.preset("tiny"), mode="recurrent").mode == "recurrent"


def test_caches_are_one_family_with_batch_length_and_bytes():
    for name, layer in tiny_mixers().items():
        cache = layer.new_cache(3, 16)
        assert cache.batch_size == 3 and cache.length == 0, name
        _, returned = layer(torch.randn(3, 5, 128), cache)
        assert returned is cache and cache.length == 5, name
        assert cache.nbytes() > 0
    kda_cache = tiny_mixers()["kda"].new_cache(3, 16)
    assert kda_cache.nbytes() == 3 * (4 * 32 * 32 * 4 + 3 * 3 * 4 * 32 * 4)  # fp32 state + conv tails
    assert isinstance(tiny_mixers()["mla"].new_cache(1, 4), MLACache)


@pytest.mark.parametrize("name", ["kda", "gdn", "mla"])
def test_bad_input_is_named(name):
    layer = tiny_mixers()[name]
    with pytest.raises(ValueError, match=r"x must be \[B, T, d_model=128\]"):
        layer(torch.randn(2, 5, 64))
    with pytest.raises(ValueError, match="at least one token"):
        layer(torch.randn(2, 0, 128))
    with pytest.raises(ValueError, match="cache does not match this layer and batch"):
        layer(torch.randn(2, 1, 128), layer.new_cache(3, 8))
