"""Chapter 00 and the README: K3's size and sparsity, from the accounting. Each function is a number a lesson quotes
(see :mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

import functools

from k3course import accounting
from k3course.config import PUBLISHED_PARAMS, K3Config
from k3course.lessons.quoted.markers import quoted


@functools.cache
def preset_count(name: str) -> accounting.ParamCount:
    """The accounting's parameter count of the preset ``name`` (computed once)."""
    return accounting.param_count(K3Config.preset(name))


def k3_config() -> K3Config:
    """The ``kimi-k3`` preset."""
    return K3Config.preset("kimi-k3")


@quoted
def total_params_t(name: str = "kimi-k3") -> float:
    """A preset's total parameters, in trillions."""
    return preset_count(name).total / 1e12


@quoted
def total_params_b(name: str = "kimi-k3") -> float:
    """A preset's total parameters, in billions."""
    return preset_count(name).total / 1e9


@quoted
def active_params_b(name: str = "kimi-k3") -> float:
    """A preset's active parameters per token, in billions."""
    return preset_count(name).active / 1e9


@quoted
def total_params_m(name: str) -> float:
    """A preset's total parameters, in millions."""
    return preset_count(name).total / 1e6


@quoted
def active_params_m(name: str) -> float:
    """A preset's active parameters per token, in millions."""
    return preset_count(name).active / 1e6


@quoted
def published_gap(name: str, which: str) -> float:
    """Our count over the published one, minus 1, for ``which`` = "total" or "active"."""
    count, (total, active) = preset_count(name), PUBLISHED_PARAMS[name]
    return count.total / total - 1 if which == "total" else count.active / active - 1


@quoted
def published_missing_b(name: str) -> float:
    """Published total minus our count, in billions (what the published dimensions leave unexplained)."""
    return (PUBLISHED_PARAMS[name][0] - preset_count(name).total) / 1e9


@quoted
def published_b(name: str, which: str) -> float:
    """The published total or active parameters, in billions."""
    total, active = PUBLISHED_PARAMS[name]
    return (total if which == "total" else active) / 1e9


@quoted
def component_b(name: str, component: str, which: str = "total") -> float:
    """One component's parameters (total or active), in billions."""
    total, active = preset_count(name).components[component]
    return (total if which == "total" else active) / 1e9


@quoted
def active_without_b(name: str, *components: str) -> float:
    """Active parameters without the named components (e.g. the embedding), in billions."""
    count = preset_count(name)
    return (count.active - sum(count.components[c][1] for c in components)) / 1e9


@quoted
def component_share(name: str, component: str, which: str = "total") -> float:
    """A component's share of the total (or of the active) parameters."""
    count = preset_count(name)
    total, active = count.components[component]
    return total / count.total if which == "total" else active / count.active


@quoted
def active_fraction(name: str = "kimi-k3") -> float:
    """Active over total parameters."""
    return preset_count(name).active / preset_count(name).total


@quoted
def activation_ratio(name: str = "kimi-k3") -> float:
    """Routed experts active per token over routed experts (top_k / n_routed_experts)."""
    return accounting.activation_ratio(K3Config.preset(name))


@quoted
def expert_ratio_over(name: str, other: str) -> float:
    """How many times ``name``'s routed experts outnumber ``other``'s."""
    return K3Config.preset(name).n_routed_experts / K3Config.preset(other).n_routed_experts


@quoted
def layers(name: str, kind: str) -> int:
    """A preset's number of layers of one kind: "kda", "mla", "moe", "dense" or "all"."""
    cfg = K3Config.preset(name)
    return {"kda": cfg.n_kda_layers, "mla": cfg.n_mla_layers, "moe": cfg.n_moe_layers,
            "dense": cfg.first_k_dense, "all": cfg.n_layers}[kind]


@quoted
def layer_share(name: str, kind: str) -> float:
    """The share of a preset's layers of one kind ("kda", "mla", ...)."""
    return layers(name, kind) / layers(name, "all")


@quoted
def latent_expert_saving() -> float:
    """How many times more routed-expert parameters K3 would have with full-width experts (ℓ = d)."""
    cfg = k3_config()
    return cfg.d_model / cfg.latent_dim
