"""The MoE's routing record across micro-batches, zero-token inputs, top_k = n and the meta-device build."""

from __future__ import annotations

import pytest
import torch
from helpers import devices_computed_on

from k3course.accounting import moe_layer_params
from k3course.config import K3Config
from k3course.moe import LatentMoE, MoE, quantile_balance_bias


def grid_layer(balancing: str, latent: bool = True, top_k: int = 2, seed: int = 0) -> MoE:
    """A small MoE whose router weights are multiples of 1/8, so router logits are exact whatever the batch."""
    generator = torch.Generator().manual_seed(seed)
    layer = MoE(16, 8, top_k, n_shared=1, d_expert=8, d_latent=8 if latent else None, balancing=balancing,
                gamma=0.01, generator=generator)
    with torch.no_grad():
        layer.router.copy_(torch.randint(-4, 5, (16, 8), generator=generator) / 8)
        layer.bias.copy_(torch.randint(-2, 3, (8,), generator=generator) / 16)
    return layer


def grid_tokens(m: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(-4, 5, (m, 16), generator=torch.Generator().manual_seed(seed)) / 4


@pytest.mark.parametrize("balancing", ["quantile", "sign"])
def test_two_micro_batches_of_8_update_like_one_batch_of_16(balancing):
    x = grid_tokens(16)
    split, whole = grid_layer(balancing), grid_layer(balancing)
    split(x[:8])
    split(x[8:])
    whole(x)
    for key in ("load", "scores"):
        got, want = split.balancing_statistics()[key], whole.balancing_statistics()[key]
        assert (got is None and want is None and balancing == "sign") or torch.equal(got, want)
    assert split.load_statistics()["tokens"] == whole.load_statistics()["tokens"] == 16
    assert split.load_statistics()["max_violation"] == whole.load_statistics()["max_violation"]
    before = split.bias.clone()
    assert split.update_bias() is True and whole.update_bias() is True
    assert torch.equal(split.bias, whole.bias) and not torch.equal(split.bias, before)


def test_the_update_uses_every_micro_batch_not_the_last():
    x = grid_tokens(32)
    layer = grid_layer("quantile")
    layer(x[:16])
    layer(x[16:])
    scores = layer.balancing_statistics()["scores"]
    assert scores.shape == (32, 8)
    want = quantile_balance_bias(scores, layer.bias, 2)
    last_only = quantile_balance_bias(scores[16:], layer.bias, 2)
    layer.update_bias()
    assert torch.equal(layer.bias, want) and not torch.equal(want, last_only)


def test_eval_records_nothing_and_reset_clears_the_record():
    layer = grid_layer("sign").eval()
    layer(grid_tokens(8))
    assert layer.balancing_statistics()["tokens"] == 0 and layer.update_bias() is False
    with pytest.raises(RuntimeError, match="needs a forward in training mode"):
        layer.load_statistics()
    layer.train()
    layer(grid_tokens(8))
    assert layer.balancing_statistics()["load"].sum() == 8 * 2
    layer.reset_statistics()
    assert layer.balancing_statistics()["load"].sum() == 0 and layer.update_bias() is False


def test_aux_and_z_loss_belong_to_the_last_micro_batch_and_carry_grad():
    layer = grid_layer("aux")
    layer(grid_tokens(8, seed=2))
    first = layer.aux_loss
    layer(grid_tokens(8, seed=3))
    assert layer.aux_loss.requires_grad and layer.z_loss.requires_grad
    fresh = grid_layer("aux")
    fresh(grid_tokens(8, seed=3))
    assert torch.equal(layer.aux_loss, fresh.aux_loss) and not torch.equal(first, layer.aux_loss)
    (layer.aux_loss + layer.z_loss).backward()
    assert layer.router.grad.abs().sum() > 0
    assert layer.update_bias() is False and torch.equal(layer.bias, fresh.bias)  # aux: the bias does not move


@pytest.mark.parametrize("balancing", ["quantile", "sign"])
def test_top_k_equal_to_n_routes_to_every_expert_and_balancing_keeps_a_centred_bias(balancing):
    layer = grid_layer(balancing, top_k=8)
    y = layer(grid_tokens(12))
    assert y.shape == (12, 16) and torch.isfinite(y).all()
    assert layer.load_statistics()["load"].tolist() == [12] * 8
    before = layer.bias.clone()
    assert layer.update_bias() is True
    # every load equals the mean: the sign rule does not move; the quantile step only centres the bias
    assert torch.allclose(layer.bias, before if balancing == "sign" else before - before.mean())


@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16)])
@pytest.mark.parametrize("latent", [True, False])
def test_zero_tokens_give_an_empty_output_with_working_gradients(shape, latent):
    layer = grid_layer("quantile", latent=latent)
    x = torch.zeros(shape, requires_grad=True)
    y = layer(x)
    assert y.shape == shape
    (y.sum() + layer.z_loss).backward()
    assert x.grad.shape == shape and float(layer.z_loss.detach()) == 0.0
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in layer.parameters())
    assert layer.update_bias() is False  # nothing was recorded


def test_wrong_width_names_x():
    with pytest.raises(ValueError, match=r"x must have shape \[..., d_model = 16\], got \(4, 15\)"):
        grid_layer("sign")(torch.zeros(4, 15))


@pytest.mark.parametrize("preset", ["tiny", "small", "kimi-k3", "kimi-k2", "deepseek-v3", "kimi-linear-48b"])
def test_meta_build_is_fast_and_matches_the_config_count(preset):
    cfg = K3Config.preset(preset)
    with torch.device("meta"):
        layer, devices = devices_computed_on(lambda: MoE.from_config(cfg))
    assert devices == {"meta"}, "nothing allocated or initialised for real"
    assert all(p.is_meta for p in layer.parameters()) and layer.bias.is_meta
    assert sum(p.numel() for p in layer.parameters()) == moe_layer_params(cfg)[0]
    on_argument = MoE.from_config(cfg, device="meta")
    assert on_argument.experts.gate_up.is_meta
    assert sum(p.numel() for p in on_argument.parameters()) == moe_layer_params(cfg)[0]


def test_device_argument_builds_real_weights_there():
    layer = LatentMoE(16, 4, 2, n_shared=1, device="cpu", generator=torch.Generator().manual_seed(4))
    assert layer.experts.down.device.type == "cpu" and layer.experts.down.abs().sum() > 0
